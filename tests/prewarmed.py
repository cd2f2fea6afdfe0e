"""Run the real ``dlaunch`` command line in a process forked from an interpreter that has already imported it.

A fresh ``python -m launcher.cli.entry`` spends about 2.5 s of CPU importing torch, torch._dynamo (the first
optimizer imports it), Hydra and dlaunch before it reads its command line. The suite starts a few hundred
commands on a 2-core CI machine, so each pytest-xdist worker keeps one such interpreter (the *zygote*) and forks
a command from it instead. The fork is a separate process, as a fresh one would be: its own pid, working
directory, environment, stdout and stderr files and exit status, stopped by a signal as any process is, and its
workers and agents are started by dlaunch itself exactly as from a fresh interpreter. Its warm forkserver is a fork
of the command (``warm.prewarm``), where torch loaded here as the workers' environment would load it: the imports a
fresh server would make again are done.

``Zygote.start`` leaves the command running and hands back a ``Forked``, which a test signals and waits for as
it would a ``subprocess.Popen`` (``conftest.popen``). What a fork cannot show, fresh interpreters cover: the
tests of import cost, of the installed console script (``tests/test_packaging.py``) and of the warm forkserver,
and every test that starts ``dlaunch`` with ``subprocess.Popen`` itself. ``DLAUNCH_TEST_FRESH=1`` runs every
command in a fresh interpreter instead.

The protocol, on the zygote's stdin and stdout, one command at a time: a JSON line ``{argv, cwd, env, out, err,
session}`` in; ``pid N`` out once forked, then ``status S`` (the raw wait status) once it has ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import shutil
import sys
import tempfile
import threading
import time

from launcher.launch.parent_death import die_with_parent


def serve() -> None:
    """The zygote: import what every command imports, then fork one child per request until stdin closes."""
    die_with_parent()
    from launcher.launch import warm

    warm.prewarm()  # torch, torch._dynamo and what a worker imports: a command's warm server is then a fork of it

    import launcher.cli.entry  # noqa: F401
    import launcher.cli.main  # noqa: F401
    import launcher.runtime.loop  # noqa: F401

    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    replies.write(b"ready\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)  # never returns
        replies.write(f"pid {pid}\n".encode())
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(f"status {status}\n".encode())
        replies.flush()


def _child(request: dict) -> None:
    """The command, as ``python -m launcher.cli.entry ARGV`` run in ``cwd`` with ``env`` would run it."""
    code = 1
    try:
        die_with_parent()
        if request.get("session"):
            os.setsid()  # as ``Popen(start_new_session=True)``: a group of its own, for ``os.killpg``
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY), (2, request["err"], os.O_WRONLY)):
            if fd == 2 and path == request["out"]:
                os.dup2(1, 2)  # ``stderr=STDOUT``: one file, one offset
                continue
            opened = os.open(path, mode)
            os.dup2(opened, fd)
            os.close(opened)
        from launcher.cli import entry

        sys.argv = [entry.__file__, *request["argv"]]
        if not sys.flags.safe_path:  # PYTHONSAFEPATH=1 (.ci/gpu-check): -m puts nothing first, and -c put nothing here
            sys.path[0] = os.getcwd()  # what ``-m`` puts first, in place of ``-c``'s ''
        sys.modules["__main__"] = entry  # what multiprocessing's forkserver re-imports in its children
        try:
            entry.entry()  # leaves through entry.leave
        except SystemExit as exc:  # an answer before the run (--help, torchrun flags): dlaunch's own exit anyway
            entry.leave(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else _print_exit(exc.code)))
    except BaseException:  # noqa: BLE001 - what a fresh interpreter prints for an uncaught exception
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _print_exit(message: object) -> int:
    print(message, file=sys.stderr)
    return 1


class Zygote:
    """One per test process, started at its first command; a command while it is busy runs fresh instead."""

    def __init__(self, root: str, env: dict[str, str]):
        self._root, self._env = root, env  # the environment it imports under: the session's, not a test's
        self._proc: subprocess.Popen | None = None
        self._busy = threading.Lock()
        # the running command's stdout and stderr files, made at the first command: every process that imports
        # the conftest builds a Zygote (spawned workers unpickling a test's function, the xdist controller), and
        # only the pytest session's closes it
        self._scratch: str | None = None

    def run(self, args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess | None:
        """``dlaunch ARGS`` forked from the zygote, to its end; None where it cannot (busy, or not on Linux)."""
        proc = self.start(args, cwd, env, merged=False)
        if proc is None:
            return None
        try:
            proc.wait(timeout)  # any other exception (pytest-timeout's, say) discards the zygote with the command
        except subprocess.TimeoutExpired:
            self._discard(proc.pid)  # as subprocess.run does on its timeout; dlaunch's workers die with it
            self._busy.release()
            raise subprocess.TimeoutExpired(proc.args, timeout, _read(proc.out), _read(proc.err)) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, _read(proc.out), _read(proc.err))

    def start(self, args: list[str], cwd, env: dict, merged: bool = True, session: bool = False) -> Forked | None:
        """``dlaunch ARGS`` forked from the zygote and left running: a handle as ``subprocess.Popen`` gives, with
        stderr in stdout where ``merged`` and a session of its own where ``session``. The zygote is this command's
        until it has ended and the handle has seen it end. None where it cannot (busy, or not on Linux)."""
        if env.get("PYTHONPATH") != self._env.get("PYTHONPATH"):  # a fork keeps the zygote's sys.path
            return None
        if sys.platform != "linux" or not self._busy.acquire(blocking=False):
            return None
        if threading.current_thread() is not threading.main_thread() and (self._proc is None or self._proc.poll() is not None):
            # The zygote dies with the thread that started it (PR_SET_PDEATHSIG follows the thread, not the process):
            # one started from a test's worker thread was SIGKILLed when that thread ended, under the next command
            self._busy.release()
            return None
        try:
            proc = self._started()
            out, err = os.path.join(self._scratch, "stdout"), os.path.join(self._scratch, "stderr")
            for path in (out, err):
                open(path, "w").close()
            err = out if merged else err
            request = {"argv": args, "cwd": str(cwd), "env": env, "out": out, "err": err, "session": session}
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            pid = int(self._reply(proc, "pid", 60).split()[1])
        except BaseException:
            if self._proc is not None:
                self._discard(None)
            self._busy.release()
            raise
        return Forked(self, ["dlaunch", *args], pid, out, err)

    def _discard(self, pid: int | None) -> None:
        """Kill the command and the zygote (its next command starts a new one); dlaunch's workers die with them."""
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._proc.kill()
        self._proc.wait(30)
        self._proc = None

    def _started(self) -> subprocess.Popen:
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="dlaunch-zygote-")
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                # ``tests`` from the checkout, last on the path: ``launcher`` is the installed copy, as a fresh
                # command's is (a checkout first would shadow a non-editable install, as on a GPU machine)
                [sys.executable, "-c", f"import sys; sys.path.append({self._root!r}); from tests import prewarmed; prewarmed.serve()"],
                cwd=self._scratch, env=self._env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,  # unbuffered: select sees every reply
            )
            self._reply(self._proc, "ready", 120)
        return self._proc

    @staticmethod
    def _reply(proc: subprocess.Popen, word: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                if left <= 0:
                    raise subprocess.TimeoutExpired(word, timeout)
                continue
            line = proc.stdout.readline().decode()
            if not line.startswith(word):
                raise RuntimeError(f"the zygote answered {line!r}, expected {word!r} (exit status {proc.poll()})")
            return line

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(30)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


class Forked:
    """A command forked from the zygote, used as a ``subprocess.Popen(..., stdout=PIPE, text=True)`` is: ``pid``,
    ``poll``, ``wait``, ``send_signal``, ``kill`` and ``communicate`` (its output, once it has ended)."""

    def __init__(self, zygote: Zygote, args: list[str], pid: int, out: str, err: str):
        self.args, self.pid, self.out, self.err = args, pid, out, err
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._zygote._proc.stdout], [], [], 0)[0]:
            self.wait(60)  # its status line is there
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            zygote = self._zygote
            try:
                reply = zygote._reply(zygote._proc, "status", 1e9 if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                raise  # still running, as Popen.wait's timeout leaves it
            except BaseException:  # the zygote is gone or garbled: the command with it, and the next one starts anew
                zygote._discard(self.pid)
                zygote._busy.release()
                raise
            self.returncode = os.waitstatus_to_exitcode(int(reply.split()[1]))
            zygote._busy.release()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout, _read(self.out)) from None
        return _read(self.out), (None if self.err == self.out else _read(self.err))


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
