"""``dlaunch resume SWEEP_DIR`` with a new value for a key the sweep sweeps, and one job of a sweep resumed alone."""

from __future__ import annotations

import json

import pytest

from tests.conftest import PROBE, dlaunch

pytestmark = pytest.mark.slow


def failed_sweep(tmp_path):
    """A sweep over ``recipe.fail_replica`` whose job 1 fails at step 5, after its checkpoint of step 4."""
    sweep = tmp_path / "multirun" / "s2"
    proc = dlaunch("-m", f"recipe.entry={PROBE}", "recipe.fail_replica=-1,0", "recipe.fail_step=5", "trainer.steps=8",
                   "strategy=mirrored", "cluster=1x2", "trainer.checkpoint.every_steps=2", "hydra.sweep.dir=multirun/s2",
                   cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    return sweep


def test_a_new_value_for_a_swept_key_is_refused_with_the_command_for_the_job_that_needs_it(tmp_path):
    """``dlaunch resume SWEEP recipe.fail_replica=-1`` made the sweep one job: job 0 said it had completed, the failed
    job 1 was never resumed and was dropped from multirun.yaml and sweep_summary.json, and dlaunch exited 0. One value
    cannot stand for each job's own, so it is refused (exit 2), naming the key and the command for the failed job;
    the sweep's record is kept."""
    sweep = failed_sweep(tmp_path)
    recorded = {name: (sweep / name).read_bytes() for name in ("multirun.yaml", "sweep_summary.json", "sweep_summary.csv")}
    proc = dlaunch("resume", "multirun/s2", "recipe.fail_replica=-1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "recipe.fail_replica is swept by this sweep (recipe.fail_replica=-1,0)" in text, text
    assert f"dlaunch resume {sweep.resolve() / '1'} recipe.fail_replica=-1   (job 1: failed)" in text, text
    assert "Launching" not in text and "completed already" not in text and len(text.splitlines()) <= 5
    assert {name: (sweep / name).read_bytes() for name in recorded} == recorded


def test_one_job_resumed_alone_updates_its_row_of_the_sweeps_summary_and_its_label(tmp_path):
    """After ``dlaunch resume SWEEP/1 KEY=VALUE`` completed job 1, sweep_summary.json still said it had failed, and
    ``dlaunch report``'s legend and table labelled it ``trainer.resume=auto``, which the resume had added."""
    import csv

    from launcher.cli.report import jobs as report_jobs

    sweep = failed_sweep(tmp_path)
    proc = dlaunch("resume", "multirun/s2/1", "recipe.fail_replica=-1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [(r["job"], r["status"], r["resumed_from_step"], r["error"]) for r in rows] == [
        (0, "completed", None, None), (1, "completed", 4, None)], rows
    assert "recipe.fail_replica=-1" in rows[1]["overrides"] and "trainer.resume" not in rows[1]["overrides"]
    with open(sweep / "sweep_summary.csv") as f:
        assert [(r["status"], r["dir"]) for r in csv.DictReader(f)] == [
            ("completed", str(sweep.resolve() / n)) for n in "01"]
    report = dlaunch("report", "multirun/s2", cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "trainer.resume" not in (sweep / "report.html").read_text()
    loaded = [report_jobs.load(sweep / n, n) for n in "01"]
    report_jobs.label(loaded)
    assert all("trainer.resume" not in j.label and "recipe.fail_replica=-1" in j.label for j in loaded), loaded


def test_one_jobs_dry_run_resume_leaves_the_sweeps_summary_as_it_was(tmp_path):
    """`dlaunch resume SWEEP_DIR/N launch.dry_run=true` rewrote the sweep's summary (a dry run writes nothing)."""
    sweep = tmp_path / "sweep"
    ran = dlaunch("-m", "trainer.steps=3", "trainer.seed=0,1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    kept = {name: (sweep / name).read_bytes() for name in ("sweep_summary.json", "sweep_summary.csv")}
    dry = dlaunch("resume", str(sweep / "1"), "launch.dry_run=true", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert {name: (sweep / name).read_bytes() for name in kept} == kept
    assert "row of" not in dry.stderr
