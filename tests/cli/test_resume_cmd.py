"""After a signal dlaunch prints the resume command; ``dlaunch resume RUN_DIR`` continues the run in its directory."""

from __future__ import annotations

import signal

import pytest

from launcher.checkpoint import layout
from tests.conftest import dlaunch
from tests.launch.test_restarts import logged_steps
from tests.launch.test_signals import stop_with

pytestmark = pytest.mark.slow


def test_sigterm_prints_the_resume_command_and_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    code, _, out = stop_with(run_dir, signal.SIGTERM, "strategy=one_device", "cluster=1x1", in_process=True)
    assert code == 143, out[-3000:]
    assert f"resume with: dlaunch resume {run_dir}" in out, out[-3000:]
    step = layout.read_manifest(layout.latest(run_dir / "checkpoints"))["step"]
    proc = dlaunch("resume", str(run_dir), f"trainer.steps={step + 3}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from step {step}" in proc.stdout
    assert logged_steps(run_dir) == list(range(1, step + 4))


def test_resume_names_a_directory_that_is_not_a_run(tmp_path):
    proc = dlaunch("resume", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{tmp_path} is not a dlaunch run directory" in proc.stderr
