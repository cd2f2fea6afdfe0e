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
