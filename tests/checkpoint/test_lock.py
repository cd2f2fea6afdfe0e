"""One live run per run (and checkpoint) directory, held by real processes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.checkpoint import lock

HOLDER = """
import sys, time
from pathlib import Path
from pathlib import Path  # noqa: E402

from launcher.checkpoint import lock
with lock.holding(Path(sys.argv[1]), "hydra.run.dir"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A process that holds ``tmp_path / 'run'`` until the test kills it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_a_live_holder_is_named_with_host_pid_and_start_time(tmp_path, holder):
    with pytest.raises(lock.Busy) as caught:
        with lock.holding(tmp_path / "run", "hydra.run.dir"):
            pass
    text = str(caught.value)
    assert f"pid {holder.pid} on host {socket.gethostname()}, started 20" in text
    assert "hydra.run.dir" in text


def test_a_holder_killed_with_sigkill_is_taken_over_with_a_warning(tmp_path, holder, caplog):
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    with caplog.at_level(logging.WARNING, logger="dlaunch"):
        with lock.holding(tmp_path / "run", "hydra.run.dir"):
            pass
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"pid {holder.pid}" in warning and "which is gone" in warning


def test_a_clean_release_leaves_nothing_to_warn_about(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dlaunch"):
        for _ in range(2):
            with lock.holding(tmp_path / "run", "hydra.run.dir"):
                pass
        with pytest.raises(RuntimeError):  # an exception is an exit path too
            with lock.holding(tmp_path / "run", "hydra.run.dir"):
                raise RuntimeError("boom")
        with lock.holding(tmp_path / "run", "hydra.run.dir"):
            pass
    assert not caplog.records
    assert (tmp_path / "run" / ".dlaunch.lock").read_text() == ""


def test_the_lock_is_not_inherited_by_processes_the_holder_starts(tmp_path):
    with lock.holding(tmp_path / "run", "hydra.run.dir"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with lock.holding(tmp_path / "run", "hydra.run.dir"):  # the child still runs; the lock is free
            pass
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_dry_run_is_refused_where_a_live_run_holds_the_directory_and_writes_nothing(tmp_path, holder):
    path = tmp_path / "run" / ".dlaunch.lock"
    held_by = path.read_bytes()
    with pytest.raises(lock.Busy, match=f"pid {holder.pid}"):
        lock.check_free(path, "hydra.run.dir")
    assert path.read_bytes() == held_by
    lock.check_free(tmp_path / "elsewhere" / ".dlaunch.lock", "trainer.checkpoint.dir")  # no file: no live holder
    assert not (tmp_path / "elsewhere").exists()


def test_a_directory_that_cannot_be_made_is_a_config_error_not_a_traceback(run_dlaunch):
    """The checks before the lock pass /proc/x as root (a writable-looking parent), but mkdir fails there: that was
    a Hydra traceback and exit 1. Now it names the key and exits 2, like any directory dlaunch cannot use."""
    with pytest.raises(lock.Unusable, match="/proc/dlaunch-nowhere cannot be written"):
        with lock.holding(Path("/proc/dlaunch-nowhere"), "trainer.checkpoint.dir"):
            pass
    proc, _ = run_dlaunch("trainer.checkpoint.dir=/proc/dlaunch-nowhere", "trainer.checkpoint.every_steps=5",
                          "cluster.device=cpu")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "trainer.checkpoint.dir = /proc/dlaunch-nowhere" in proc.stderr
