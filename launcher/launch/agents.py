"""How dlaunch starts an agent process: a parameter-server task's, or an emulated node's.

Each agent is what one machine would run: a torch.distributed.elastic agent that
starts that task's or node's workers. As a fresh interpreter (``python -m
launcher.launch.tasks ...``) it spends about 3.5 s of CPU importing torch before it
does anything, and a parameter-server job on one machine starts five at once.

Where the console script's warm server runs for this job (``warm.forks_agents``:
a local CPU job), each agent is forked from it instead: an interpreter whose
imports are done, and which no thread has run in. The fork then takes dlaunch's
environment and working directory as they are now, as a fresh agent would, and
dies with dlaunch (its parent, the server, does). Its elastic agent forks its workers
from a server the agent forks of itself (``launch/agent_server.py``). ``launch.warm_workers=false``, CUDA nodes and
``main()`` called from another program start fresh interpreters, as before::

    proc = agents.start(tasks.task_main, args)   # a subprocess.Popen, or a Forked
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import traceback
from multiprocessing import reduction
from typing import Any, Callable, Iterable, Iterator, Union

from launcher.launch import agent_server, warm

_MOVED: dict[int, int] = {}  # in a forked agent: dlaunch's number of each descriptor it passed -> its number here
_MAX_PASSED = 200  # multiprocessing sends at most 256 descriptors to its server with each process, 4 its own


def start(main: Callable[[list[str]], int], args: list[str], pass_fds: tuple[int, ...] = (),
          env: dict[str, str] | None = None) -> Agent:
    """Start ``main(args)`` as an agent: forked from the warm server where this job has one (``env``: None), else
    ``python -u -m MAIN_MODULE ARGS`` (the module runs ``main(sys.argv[1:])``). ``pass_fds``: descriptors the agent
    keeps; it finds each by dlaunch's number through ``inherited_fd``."""
    # a removed working directory: multiprocessing cannot start a process there (a fresh one keeps it)
    if env is None and warm.forks_agents() and working_directory() is not None and len(pass_fds) < _MAX_PASSED:
        return Forked(main, args, pass_fds)
    return subprocess.Popen([sys.executable, "-u", "-m", main.__module__, *args], env=env, pass_fds=pass_fds)


def how() -> str:
    """How ``start`` will start this job's agents, for its log line."""
    if warm.forks_agents():
        return " (forked from a process that imported torch while dlaunch planned; launch.warm_workers=false starts fresh ones)"
    return ""


@contextlib.contextmanager
def killed_on_error(procs: Iterable[Agent]) -> Iterator[None]:
    """An error in dlaunch itself while its agents run: they are killed and reaped, not left to train on without
    it (and a forked one would hold dlaunch's exit: multiprocessing joins its children then)."""
    try:
        yield
    except BaseException:
        running = [p for p in procs if p.poll() is None]
        for p in running:
            p.kill()
        for p in running:
            p.wait()
        raise


def passed_fds() -> list[int]:
    """In a forked agent: the descriptors dlaunch passed it, by their numbers here."""
    return list(_MOVED.values())


def inherited_fd(fd: int) -> int:
    """In an agent: the number that descriptor ``fd`` of dlaunch's (one it passed) has here."""
    return _MOVED.get(fd, fd)


class Forked:
    """An agent forked from the warm server, with what its users need of ``subprocess.Popen``: ``pid``, ``poll``,
    ``returncode`` (negative: killed by that signal), ``wait`` (``subprocess.TimeoutExpired``), ``send_signal``
    and ``kill``."""

    def __init__(self, main: Callable[[list[str]], int], args: list[str], pass_fds: tuple[int, ...]):
        self.args = [main.__module__, *args]
        fds = [_Passed(fd) for fd in pass_fds]
        self._process = multiprocessing.get_context("forkserver").Process(
            target=_agent, args=(main, args, fds, dict(os.environ), working_directory()),
            name=f"dlaunch agent ({main.__module__})")
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not one that has ended: its pid may be another process's by now
            with contextlib.suppress(ProcessLookupError):  # reaped by the server, its status not yet sent
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Agent = Union[subprocess.Popen, Forked]


class _Passed:
    """A descriptor handed to a forked agent: multiprocessing sends it through the server, as it sends a socket."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _received, (self.fd, reduction.DupFd(self.fd))


def _received(fd: int, dup: Any) -> int:
    _MOVED[fd] = dup.detach()
    return _MOVED[fd]


def working_directory() -> str | None:
    """This process's working directory, for a fork to take; None where it was removed (the fork keeps its own)."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        return None


def _agent(main: Callable[[list[str]], int], args: list[str], fds: list[int], environ: dict[str, str],
           cwd: str | None) -> None:
    """In the forked agent: as a fresh ``python -u -m`` would start (dlaunch's environment, directory, signals and
    unbuffered output), then ``main``. ``fds`` are already in ``_MOVED``."""
    as_started_now(environ, cwd)
    agent_server.forked_agent()  # its workers may fork from it in turn
    for stream in (sys.stdout, sys.stderr):  # as -u: each line out at once, whatever the server's buffering
        stream.reconfigure(line_buffering=True, write_through=True)
    sys.argv = [getattr(sys.modules[main.__module__], "__file__", None) or main.__module__, *args]  # as -m sets it
    try:
        code = main(args)
        agent_server.shutdown()
    except KeyboardInterrupt:  # as Python ends a fresh one: the traceback, then by SIGINT (multiprocessing: exit 1)
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    raise SystemExit(code)


def as_started_now(environ: dict[str, str], cwd: str | None) -> None:
    """In a process forked from a warm server: what a fresh interpreter started now would have. The stop signals'
    default actions, multiprocessing's default start method, ``environ`` and ``cwd`` (None: the server's); and the
    server's keep-alive pipe closed, so the server ends with dlaunch alone, and this process with the server."""
    from launcher.launch import forkserver_guard
    from launcher.runtime.worker import fresh_start_method, release_forkserver

    forkserver_guard.restore_stop_signals()
    release_forkserver()
    fresh_start_method()
    os.environ.clear()
    os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
