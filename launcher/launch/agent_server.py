"""An agent's own warm server: an emulated node's or a parameter-server task's workers forked, not started fresh.

An agent forked from dlaunch's warm server (``launch/agents.py``) has imported all that a worker imports (torch,
torch._dynamo, dlaunch), and no thread has run in it yet. As it starts its workers, it forks itself once more into a
``multiprocessing`` forkserver, in the workers' environment, and its elastic agent forks each worker from that
(``start_method="forkserver"``), as dlaunch's own single-node workers fork from its warm server. A fresh worker
instead spends about 3.3 s of CPU importing before it reads its job: a 20-step ``cluster=2x2`` run took 26.3 CPU-s
with fresh workers and 7.4 with forked ones, a parameter-server run of 5 tasks 58.6 and 11.0 (docs/PERFORMANCE.md).

The chain is the one dlaunch's own warm workers have: the agent -> its server, which dies with the agent and stays
through SIGTERM and SIGHUP (``forkserver_guard.guard_forked_server``) -> its workers (``die_with_launcher``), each
of which lets go of the server's keep-alive pipe (``release_forkserver``). The agent stops and reaps its server
when it ends (``shutdown``).

Workers start fresh as before where the agent is not a fork of the warm server (``launch.warm_workers=false``, CUDA
nodes), where a thread already runs in it (``forked_server.possible``), or where torch loaded with other settings
(``TORCH*``, ``OMP_*``, ``PYTHON*``) than the workers' environment has.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from multiprocessing import forkserver

from launcher.launch import forked_server

_forked_agent = False  # this process is an agent forked from the warm server (agents._agent says so)
_pid: int | None = None  # the server this agent forked


def forked_agent() -> None:
    """In an agent forked from the warm server, before its main: its workers may be forked from it."""
    global _forked_agent
    _forked_agent = True


def start() -> bool:
    """At the workers' start, in their environment: this agent's server, forked now where it can be; whether the
    workers are to be forked from it."""
    global _pid
    if _pid is not None:
        return True
    if not (_forked_agent and forked_server.possible() and _torch_loaded_as_now()):
        return False
    _pid = forked_server.fork(_prepare)
    if _pid is None:
        return False
    # A server that died is started again by multiprocessing itself, fresh: it imports and is guarded as dlaunch's is.
    from launcher.launch.warm import PRELOAD

    forkserver.set_forkserver_preload(PRELOAD)
    return True


def _prepare() -> None:
    """In the forked server: guarded as dlaunch's is. The descriptors dlaunch passed the agent are closed first: a
    worker holding a copy of its node's lifeline (``emulate._lifelines``) would hide the agent's end from the other
    nodes."""
    from launcher.launch import agents, forkserver_guard

    for fd in set(agents.passed_fds()):
        os.close(fd)
    forkserver_guard.guard_forked_server()


def _torch_loaded_as_now() -> bool:
    """This process started and torch loaded in it in the warm server's environment: the workers' own must not
    differ in what Python reads as it starts and torch as it loads (``env.import_time_settings``)."""
    from launcher.cluster.env import import_time_settings
    from launcher.launch import forkserver_guard

    return import_time_settings(os.environ) == import_time_settings(forkserver_guard.LOADED_WITH)


def started() -> bool:
    return _pid is not None


def shutdown(wait_s: float = 10.0) -> None:
    """At the agent's end: once its server (the one it forked, or one multiprocessing started in its place) has
    reaped every worker, kill and reap it."""
    global _pid
    if _pid is None:
        return
    from launcher.launch.warm import has_children

    server = forkserver._forkserver
    pid = server._forkserver_pid
    deadline = time.monotonic() + wait_s
    while pid is not None and time.monotonic() < deadline and has_children(pid):
        time.sleep(0.01)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # at once: left to its keep-alive pipe, it would shut an interpreter down
        server._stop()  # reaps it, closes this end of its keep-alive pipe, removes its socket
    _pid = None
