"""A whole ``dlaunch`` job meeting trouble: a worker that raises, and Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import PROBE, summary

pytestmark = pytest.mark.slow


def workers_of(run_dir) -> list[str]:
    """Live processes started for this run (its job file is on their command line)."""
    out = subprocess.run(["ps", "-eww", "-o", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(run_dir) in line and "launcher.runtime.worker" in line]


def test_a_raising_worker_is_reported_once_and_stops_the_job(run_dlaunch):
    started = time.monotonic()
    proc, run_dir = run_dlaunch(
        "strategy=mirrored", "cluster=1x2", f"recipe.entry={PROBE}", "+recipe.fail_replica=1", "+recipe.fail_step=3",
        "trainer.steps=500", "trainer.log_every=1",
    )
    assert proc.returncode == 1
    assert time.monotonic() - started < 60
    out = proc.stdout + proc.stderr
    assert out.count("root cause") == 1
    assert out.count("Traceback (most recent call last)") == 1
    assert "worker rank 1 failed" in out and "RuntimeError: injected failure on replica 1 at step 3" in out
    assert "last logged step 2" in out
    s = summary(run_dir)
    assert s["status"] == "failed" and s["error"]["rank"] == 1
    assert workers_of(run_dir) == []


def test_ctrl_c_stops_every_worker(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli.main", "strategy=mirrored", "cluster=1x2", "trainer.steps=1000000",
         "trainer.log_every=50", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 90
    while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert len(workers_of(run_dir)) == 2, "the workers should be training"
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:  # never leave a training job behind when this test fails
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output[-2000:]
    time.sleep(0.5)
    assert workers_of(run_dir) == []
