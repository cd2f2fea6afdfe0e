"""Processes started for a run die with the process that started them, however it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from launcher.launch import parent_death
from tests.conftest import alive, wait_for

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")

# A parent that starts a child which imports the forkserver's guard (as the warm forkserver does first), then waits.
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import launcher.launch.forkserver_guard, time; print('armed', flush=True); time.sleep(600)"],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "armed\\n"
    print(child.pid, flush=True)
    time.sleep(600)
""")


@linux_only
def test_the_forkserver_guard_makes_a_process_die_with_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert alive(child)
        parent.send_signal(signal.SIGKILL)  # no handler runs, no pipe is read: only the kernel's parent-death signal
        parent.wait()
        wait_for(lambda: not alive(child), timeout_s=30)  # the kernel's signal is immediate; the slack is for a busy machine
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


@linux_only
def test_a_parent_already_gone_when_the_request_is_made_kills_at_once(monkeypatch):
    parents = iter([4242, 1])  # reparented between the two looks
    killed = []
    monkeypatch.setattr(parent_death.os, "getppid", lambda: next(parents))
    monkeypatch.setattr(parent_death.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(parent_death, "_prctl", lambda *args: 0)
    parent_death.die_with_parent()
    assert killed == [(os.getpid(), signal.SIGKILL)]
