"""Processes that must not outlive the process that started them, whatever killed it (SIGKILL, the OOM killer).

The kernel sends them SIGKILL when their parent dies (``PR_SET_PDEATHSIG``). The
chain from dlaunch down is: dlaunch -> the warm forkserver (``forkserver_guard``)
-> its forked workers; or dlaunch -> a worker started as a fresh interpreter, or
an emulated node's or a task's agent (``die_with_parent`` at their start). ``run_function``'s workers
die with the process that called it, or with the server they were forked from, which dies with that process.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies; at once if the parent is already gone.

    The request covers only a parent alive when it is made: a parent that died just
    before it (this process was reparented) would never trigger it.
    """
    if sys.platform != "linux":
        return
    parent = os.getppid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def _prctl(option: int, value: int) -> int:
    import ctypes

    return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)
