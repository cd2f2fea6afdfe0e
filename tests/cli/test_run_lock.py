"""A second ``dlaunch`` on a directory that a live run holds exits 2 naming the holder; a SIGKILLed holder is taken over."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import pytest

from tests.conftest import command, wait_for

pytestmark = pytest.mark.slow
WIDE = {"COLUMNS": "1000"}  # the holder's line unwrapped
LONG = ("recipe=linear", "cluster.device=cpu", "trainer.steps=10000000", "trainer.log_every=100", "trainer.checkpoint.every_steps=1000000")


def test_a_live_run_keeps_its_directories_to_itself(run_dlaunch, tmp_path):
    run_dir, ckpt = tmp_path / "first", tmp_path / "shared-checkpoints"
    first = subprocess.Popen(
        command(*LONG, f"trainer.checkpoint.dir={ckpt}", f"hydra.run.dir={run_dir}"),
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), timeout_s=120)
        holder = f"pid {first.pid} on host {socket.gethostname()}, started "
        record = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}

        proc, _ = run_dlaunch("recipe=linear", "trainer.steps=5", name="first", env=WIDE)
        assert proc.returncode == 2 and "hydra.run.dir" in proc.stdout + proc.stderr and holder in proc.stdout + proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stdout + proc.stderr
        # the refused command left the live run's record alone: `dlaunch resume` replays the live run's command
        assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == record

        args = ("recipe=linear", "trainer.steps=5", "trainer.checkpoint.every_steps=5", f"trainer.checkpoint.dir={ckpt}")
        proc, second = run_dlaunch(*args, name="second", env=WIDE)
        assert proc.returncode == 2 and "trainer.checkpoint.dir" in proc.stdout + proc.stderr and holder in proc.stdout + proc.stderr, proc.stderr[-2000:]
        assert not (second / "metrics.jsonl").exists()

        # a sweep job whose checkpoint directory is held is refused (exit 2); the others run; the sweep as a whole
        # reports a failed job with 1, as for any failed job (jobs sharing one directory are refused up front)
        proc, _ = run_dlaunch("-m", *args[:-1], f"trainer.checkpoint.dir={ckpt},{tmp_path / 'own'}",
                              f"hydra.sweep.dir={tmp_path / 'sweep'}", name="unused", env=WIDE)
        assert proc.returncode == 1 and proc.stderr.count(holder) == 1, proc.stderr[-3000:]
        assert (tmp_path / "own" / "step-00000005").is_dir()

        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        proc, _ = run_dlaunch(*args, name="first", env=WIDE)
        assert proc.returncode == 0, proc.stderr[-3000:]
        taken = " ".join((proc.stdout + proc.stderr).split())
        assert taken.count(f"pid {first.pid} on host") == 2 and "which is gone" in taken  # the run dir's and the checkpoints'
    finally:
        if first.poll() is None:
            first.kill()
        first.wait(timeout=30)
