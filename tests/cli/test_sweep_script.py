"""Sweeps of a user's own script: each job's record keeps its arguments, and the table ranks jobs by its logged loss."""

from __future__ import annotations

import json
import shutil

from tests.conftest import FIXTURES, dlaunch

CHIEF = FIXTURES / "chief_metrics.py"


def test_a_sweep_over_a_scripts_arguments_ranks_its_jobs_by_the_loss_the_script_logged(tmp_path):
    """`script=PATH` beside `script.args=...` (Hydra alone would let one replace the other), swept; each job's
    summary takes its final loss from the script's own metrics.jsonl, so the sweep's table has it."""
    shutil.copy(CHIEF, tmp_path / "chief_metrics.py")
    sweep_dir = tmp_path / "sweep"
    proc = dlaunch("-m", "script=chief_metrics.py", "script.args=[--steps,2],[--steps,3]",
                   f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]
    logged = [json.loads((sweep_dir / str(j) / "metrics.jsonl").read_text().splitlines()[-1]) for j in (0, 1)]
    assert [(j["status"], j["final_loss"]) for j in jobs] == [("completed", r["loss"]) for r in logged]
    assert [r["step"] for r in logged] == [2, 3]
    # as typed, not as dlaunch composes them (++script.path=..., ++script.args=...)
    assert "every job: script=chief_metrics.py cluster.device=cpu\n" in proc.stdout
    assert [j["overrides"] for j in jobs] == [f"script=chief_metrics.py script.args=[--steps,{n}] cluster.device=cpu"
                                              for n in (2, 3)]


def test_a_sweeps_record_of_each_job_keeps_the_scripts_arguments_after_the_dashes(tmp_path):
    """`-- --steps 2` reached every job, but the `every job:` line and sweep_summary's overrides left it out: a job
    run again from its record ran 8 steps, not 2."""
    shutil.copy(CHIEF, tmp_path / "chief_metrics.py")
    sweep_dir = tmp_path / "sweep"
    proc = dlaunch("-m", "script=chief_metrics.py", "trainer.seed=0,1", f"hydra.sweep.dir={sweep_dir}", "--", "--steps", "2",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every job: script=chief_metrics.py cluster.device=cpu -- --steps 2\n" in proc.stdout, proc.stdout[-3000:]
    jobs = json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]
    assert [j["overrides"] for j in jobs] == [f"script=chief_metrics.py trainer.seed={n} cluster.device=cpu -- --steps 2"
                                              for n in (0, 1)]
    assert [json.loads((sweep_dir / str(j) / "metrics.jsonl").read_text().splitlines()[-1])["step"] for j in (0, 1)] == [2, 2]


def test_a_refused_sweep_jobs_row_keeps_the_scripts_arguments_too(tmp_path):
    """A job the plan refuses (one_device on 1x2) is recorded apart from the others: its row lacked `-- --steps 2`,
    so the `every job:` line lost it and the other row repeated it."""
    shutil.copy(CHIEF, tmp_path / "chief_metrics.py")
    sweep_dir = tmp_path / "sweep"
    proc = dlaunch("-m", "script=chief_metrics.py", "strategy=one_device,mirrored", "cluster=1x2",
                   f"hydra.sweep.dir={sweep_dir}", "--", "--steps", "2", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "every job: script=chief_metrics.py cluster=1x2 cluster.device=cpu -- --steps 2\n" in proc.stdout, proc.stdout[-3000:]
    jobs = json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]
    assert [(j["status"], j["overrides"].endswith(" -- --steps 2")) for j in jobs] == [("config error", True), ("completed", True)]


WRITES_HERE = """import sys
from pathlib import Path

Path("out.txt").write_text(" ".join(sys.argv[1:]))  # relative: the job's own directory under hydra.job.chdir=true
"""


def test_with_hydra_job_chdir_each_job_runs_in_its_own_directory_and_finds_the_script_beside_the_command(tmp_path):
    """Each job was refused with `script.path=writes_here.py: no such file: SWEEP/0/writes_here.py`: the pre-check's
    key for a script's job (`~recipe`) missed Hydra's record of it (`~recipe=null`), so the job validated again, from
    the job's directory. A range axis (jobs the pre-check cannot list) is validated in the job, beside the command."""
    (tmp_path / "writes_here.py").write_text(WRITES_HERE)
    sweep_dir = tmp_path / "sweep"
    proc = dlaunch("-m", "script=writes_here.py", "script.args=[a],[b]", "input.seed=range(1,2)", "hydra.job.chdir=true",
                   f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(sweep_dir / str(j) / "out.txt").read_text() for j in (0, 1)] == ["a", "b"]
    assert not (tmp_path / "out.txt").exists()


def test_a_scripts_job_has_the_key_its_pre_check_gave_it():
    """Hydra records the pre-check's `~recipe` as `~recipe=null`: the keys differed, so every script job composed and
    validated itself a second time (and, under hydra.job.chdir, from the wrong directory)."""
    from launcher.cli.job import job_key

    typed = ["++script.path=w.py", "~recipe", "hydra.job.chdir=true"]
    assert job_key(["~recipe=null", "++script.path=w.py"]) == job_key(typed) == ("++script.path=w.py", "~recipe")
    assert job_key(["~input.seed=3"]) == ("~input.seed=3",)  # a deletion of one value keeps it
