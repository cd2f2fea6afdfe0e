"""``agents.start``: an agent forked from the warm server behaves as the fresh ``python -u -m`` one it replaces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from multiprocessing import forkserver
from pathlib import Path

import pytest

from launcher.cluster.env import quiet_cpp_variables
from launcher.launch import agents, warm
from tests.conftest import alive, process_state

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the warm server is Linux-only")


def report(argv: list[str]) -> int:
    """A stand-in agent: says where it runs, writes to the descriptor it was passed, exits with the code it is given."""
    out, fd, code = argv
    with os.fdopen(agents.inherited_fd(int(fd)), "w") as line:
        line.write("from the agent")
    Path(out).write_text(json.dumps({"pid": os.getpid(), "cwd": agents.working_directory(), "argv": sys.argv,
                                     "mark": os.environ.get("DLAUNCH_TEST_MARK"),
                                     "sigterm": str(signal.getsignal(signal.SIGTERM))}))
    return int(code)


def sleeper(argv: list[str]) -> int:
    time.sleep(600)
    return 0


def interrupted(argv: list[str]) -> int:
    raise KeyboardInterrupt


@pytest.fixture
def server(monkeypatch):
    """The console script's warm server, kept as a validated parameter-server job keeps it."""
    assert warm.start_early(["strategy=parameter_server"])
    monkeypatch.setattr(warm, "_kept", True)
    for name, value in quiet_cpp_variables().items():  # as dlaunch sets them for such a job (warm.quiets_cpp)
        monkeypatch.setenv(name, value)
    try:
        yield forkserver._forkserver._forkserver_pid
    finally:
        warm.stop()


def start_reporting(tmp_path: Path, code: int, more_fds: tuple[int, ...] = ()) -> tuple[agents.Agent, Path, int]:
    read, write = os.pipe()
    try:
        proc = agents.start(report, [str(tmp_path / "where.json"), str(write), str(code)],
                            pass_fds=(write, *more_fds))
    finally:
        os.close(write)  # the agent holds the only other copy: the pipe ends once it has
    return proc, tmp_path / "where.json", read


@linux_only
def test_a_forked_agent_takes_this_calls_environment_directory_and_descriptors(server, tmp_path, monkeypatch):
    monkeypatch.setenv("DLAUNCH_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    proc, where, read = start_reporting(tmp_path, 3)
    assert isinstance(proc, agents.Forked)
    assert proc.wait(timeout=60) == 3 and proc.poll() == proc.returncode == 3
    with os.fdopen(read) as pipe:
        assert pipe.read() == "from the agent"  # and then the end: no copy of the write end was left open elsewhere
    seen = json.loads(where.read_text())
    assert seen["pid"] == proc.pid != os.getpid()
    assert seen["cwd"] == str(tmp_path) and seen["mark"] == "set after the server started"
    assert seen["argv"][0] == __file__ and seen["sigterm"] == str(signal.SIG_DFL)  # as `python -m` sets them


@linux_only
def test_a_forked_agent_is_the_servers_child_and_is_signalled_waited_for_and_killed_like_a_popen(server, tmp_path,
                                                                                                monkeypatch):
    proc = agents.start(sleeper, [])
    assert process_state(proc.pid)[1] == server  # it dies with the server, which dies with dlaunch
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    sent: list[tuple[int, int]] = []
    with monkeypatch.context() as patched:
        patched.setattr(agents.os, "kill", lambda pid, signum: sent.append((pid, signum)))
        proc.send_signal(signal.SIGKILL)
    assert sent == []  # ended: nothing is sent to a pid that may be another process's now
    other = agents.start(sleeper, [])
    other.kill()
    assert other.wait(timeout=60) == -signal.SIGKILL
    # a Ctrl-C its main does not catch ends it by SIGINT, as Python ends a fresh one (multiprocessing: exit 1)
    assert agents.start(interrupted, []).wait(timeout=60) == -signal.SIGINT


@linux_only
def test_agents_running_when_dlaunch_itself_fails_are_killed_and_reaped(server):
    procs = [agents.start(sleeper, []) for _ in range(2)]
    with pytest.raises(RuntimeError, match="a bug in dlaunch"):
        with agents.killed_on_error(procs):
            raise RuntimeError("a bug in dlaunch")
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2 and not any(alive(p.pid) for p in procs)


@pytest.mark.parametrize("why", ["no server", "a removed working directory", "over 200 descriptors"])
def test_otherwise_an_agent_is_a_fresh_interpreter(tmp_path, monkeypatch, request, why):
    """``launch.warm_workers=false``, CUDA nodes (``env``), ``main()`` called from another program; a working
    directory removed under dlaunch, where multiprocessing cannot start a process and a fresh one can; and more
    descriptors than multiprocessing sends its server with one process."""
    path = [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))  # no empty entry: the directory may be gone
    more: list[int] = []
    if why != "no server" and sys.platform == "linux":
        request.getfixturevalue("server")
        probe = agents.start(sleeper, [])  # forked here, as the one below would be but for why
        assert isinstance(probe, agents.Forked)
        probe.kill()
        assert probe.wait(timeout=60) == -signal.SIGKILL
    if why == "a removed working directory" and sys.platform == "linux":
        gone = tmp_path / "gone"
        gone.mkdir()
        monkeypatch.chdir(gone)
        gone.rmdir()
    if why == "over 200 descriptors" and sys.platform == "linux":
        more = [fd for _ in range(agents._MAX_PASSED // 2) for fd in os.pipe()]
    try:
        proc, where, read = start_reporting(tmp_path, 0, tuple(more))
    finally:
        for fd in more:
            os.close(fd)
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=120) == 0
    with os.fdopen(read) as pipe:
        assert pipe.read() == "from the agent"
    assert json.loads(where.read_text())["argv"][0].endswith("test_agents.py")


if __name__ == "__main__":  # the fresh interpreter's way in: python -u -m tests.launch.test_agents ARGS
    sys.exit(report(sys.argv[1:]))
