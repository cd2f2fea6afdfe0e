"""run_function's scratch directories: removed when the call returns, and after a killed caller by the next call."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from launcher.launch import scratch


def _left_by_a_dead_call(root: Path, name: str, age_s: float = 3600, host: str | None = None) -> Path:
    path = root / f"{scratch.PREFIX}{name}"
    (path / "logs").mkdir(parents=True)
    (path / scratch.HELD).write_text(f"{host or socket.gethostname()} 12345\n")
    (path / "job.pkl").write_bytes(b"x")
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_a_dead_calls_directory_goes_and_a_live_ones_stays(tmp_path, monkeypatch):
    monkeypatch.setattr(scratch.tempfile, "tempdir", str(tmp_path))
    dead = _left_by_a_dead_call(tmp_path, "dead")
    young = _left_by_a_dead_call(tmp_path, "young", age_s=0)  # its maker may not hold its lock yet
    unheld = tmp_path / f"{scratch.PREFIX}old"  # made before calls held their directories: not known to be dead
    elsewhere = _left_by_a_dead_call(tmp_path, "other-node", host="node-7")  # a TMPDIR shared between hosts
    (tmp_path / f"{scratch.PREFIX}link").symlink_to(dead)  # a link is no directory of a call's
    unheld.mkdir()
    other = tmp_path / "elsewhere"
    other.mkdir()
    with scratch.directory() as mine:  # sweeps first
        assert mine.parent == tmp_path and mine.name.startswith(scratch.PREFIX)
        assert not dead.exists()
        assert young.exists() and unheld.exists() and other.exists() and elsewhere.exists()
        assert (tmp_path / f"{scratch.PREFIX}link").is_symlink()
        os.utime(mine, (time.time() - 3600, time.time() - 3600))
        assert scratch.sweep(tmp_path) == []  # held: this call is live, whatever its age
        assert mine.exists()
    assert not mine.exists()


def test_a_directory_held_by_another_live_process_stays(tmp_path):
    held = _left_by_a_dead_call(tmp_path, "held")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(held / scratch.HELD)!r}, os.O_WRONLY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert scratch.sweep(tmp_path) == [] and held.exists()
    finally:
        holder.kill()
        holder.wait()
    assert scratch.sweep(tmp_path) == [held] and not held.exists()  # the kernel dropped the lock with the holder
