"""A real failed run: its directory keeps the root-cause block the terminal showed, and its report shows it; a real
sweep with a job its config refused: the report's title names only what every job shares."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from launcher.cli import report  # noqa: E402
from launcher.cli.report import jobs, plots  # noqa: E402
from tests.conftest import PROBE, dlaunch  # noqa: E402


def test_a_failed_run_keeps_its_root_cause_and_the_report_shows_it(run_dlaunch):
    proc, run_dir = run_dlaunch(f"recipe.entry={PROBE}", "strategy=mirrored", "cluster=1x2", "trainer.steps=8",
                                "trainer.log_every=1", "+recipe.fail_replica=1", "+recipe.fail_step=4",
                                env={"COLUMNS": "80"})  # rich's width off a terminal, unless dlaunch says otherwise
    assert proc.returncode == 1, proc.stderr

    kept = (run_dir / "error.txt").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    exception = summary["error"]["exception"]
    assert exception == "RuntimeError: injected failure on replica 1 at step 4"
    for line in ("worker rank 1 failed: root cause", "last completed step 3", exception, "in train_step"):
        assert line in kept, (line, kept)
        assert line in proc.stdout + proc.stderr, line  # the same block as the terminal's
    assert "\x1b[" not in kept  # no colour codes in a file
    lines = proc.stderr.splitlines()  # stderr is a pipe here, as in CI: plain lines, not wrapped at 80 columns
    other = next(line for line in lines if line.startswith("  rank 0: "))
    assert other.endswith("has exited (this is rank 0)"), other
    assert all(line == line.rstrip() for line in lines), "trailing spaces off a terminal"

    assert report.main([str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text()
    assert "Root cause" in page and "worker rank 1 failed: root cause" in page
    assert exception in page
    assert page.count("data:image/png;base64,") == 2  # the partial loss curve, and lr and grad_norm


def test_a_sweeps_title_names_no_strategy_that_a_refused_job_did_not_use(tmp_path):
    """strategy=one_device,mirrored cluster=1x2: the one_device job is refused by its config and logs no curve. The
    title said `linear · mirrored · 1x2` (what the jobs with a curve shared), but half the jobs were one_device."""
    sweep = tmp_path / "sweep"
    proc = dlaunch("-m", "strategy=one_device,mirrored", "cluster=1x2", "trainer.steps=2", f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]  # job 0: config error, as expected

    assert report.main([str(sweep)]) == 0
    every = [jobs.load(sweep / n, n) for n in "01"]
    assert [j.status for j in every] == ["config error", "completed"]
    title = plots.sweep_loss(every[1:], sweep.name, every).axes[0].get_title()
    assert title == "loss: sweep sweep (linear · 2 strategies · 1x2, 2 jobs, 1 failed; 1 with a loss curve)", title
