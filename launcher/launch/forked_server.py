"""A ``multiprocessing`` forkserver made by forking this process, not by starting a fresh interpreter.

multiprocessing starts its forkserver as a new interpreter (``python -c 'from multiprocessing.forkserver import
main; ...'``), which imports torch and dlaunch again before it can fork a worker: about 3.3 s of CPU on this
project's 2-core machine. A process that has already imported them can become the server itself instead: it forks,
and the child runs multiprocessing's own server loop (``forkserver.main``) with nothing left to import. Two kinds of
process do: an agent forked from dlaunch's warm server (``launch/agent_server.py``), and a dlaunch command forked
from an interpreter that ``warm.prewarm`` prepared (``launch/warm.py``).

Only where it is safe: Linux, no other thread (one might hold a lock the fork would copy held), and a forkserver
without Python 3.14's per-server key (``_forkserver_authkey``, handed to a fresh server at its start: not done here).
The caller checks that torch loaded in the workers' environment. multiprocessing then talks to the forked server as
to its own (the client fields its ``ensure_running`` sets, the same in Python 3.10-3.13); one that died is replaced
by multiprocessing itself, fresh.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import traceback
from multiprocessing import connection, forkserver, util
from typing import Callable


def possible() -> bool:
    """Whether this process may fork itself into a server now."""
    return sys.platform == "linux" and _unkeyed() and single_threaded()


def _unkeyed() -> bool:
    """Python 3.14's forkserver authenticates each request with a key handed to the server at its start (not on
    3.10-3.13, where this is verified): not yet done here, so those start their servers fresh."""
    return not hasattr(forkserver._forkserver, "_forkserver_authkey")


def single_threaded() -> bool:
    """A fork is safe only where no other thread runs (one may hold a lock the fork would copy held)."""
    try:
        return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


_STOPS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def fork(prepare: Callable[[], None]) -> int | None:
    """Fork this process into multiprocessing's forkserver; ``prepare()`` runs in the server before it serves (its
    guard, the descriptors it must not hold). Returns the server's pid, from which multiprocessing's forkserver
    start now forks; None where the fork failed (no process to spare): the caller starts a fresh one instead.

    The stop signals are held back from the fork until ``prepare`` has put the server's own handlers in place: one
    that came between would run this process's handler in the server (dlaunch's "stopping before training starts").
    """
    for stream in (sys.stdout, sys.stderr):  # what is buffered would be written again by every worker at its exit
        with contextlib.suppress(Exception):
            stream.flush()
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    alive_r, alive_w = os.pipe()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        listener.close()
        for fd in (alive_r, alive_w):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(address)  # its socket file, where it was bound
        return None
    if pid == 0:
        _serve(prepare, listener.fileno(), alive_r, alive_w)  # never returns
    signal.pthread_sigmask(signal.SIG_SETMASK, before)
    os.close(alive_r)
    listener.close()
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return pid


def _serve(prepare: Callable[[], None], listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The forked server: prepared, its stop signals let through, then multiprocessing's own server loop until its
    client's end (the keep-alive pipe's close)."""
    code = 0
    try:
        os.close(alive_w)
        prepare()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
        forkserver.main(listener_fd, alive_r, [])
    except SystemExit:  # the keep-alive pipe's end: the client has gone
        pass
    except BaseException:  # noqa: BLE001 - the client's workers cannot start: its own report names the server's end
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)
