"""An agent's own warm server: emulated nodes' and parameter-server tasks' workers fork from a fork of their agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launcher.launch import agent_server
from tests.conftest import alive, command, process_state, summary
from tests.launch.test_restarts import STARTUP_S, finish, run_processes, start, wait_for, worker_pids

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the warm server is Linux-only")
JOBS = {
    "emulated 2x1": ("strategy=multi_worker_mirrored", "cluster=2x1", "trainer.log_every=50"),
    "parameter-server tasks": ("strategy=parameter_server", "recipe=wide_deep", "cluster.workers=1", "cluster.ps=1",
                               "trainer.log_every=16"),
}


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def descendants(root: int) -> dict[int, int]:
    """pid -> depth below ``root`` of each live process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        state = process_state(int(entry.name))
        if state is not None:
            children.setdefault(state[1], []).append(int(entry.name))
    found, level, depth = {}, [root], 0
    while level:
        depth += 1
        level = [c for p in level for c in children.get(p, [])]
        found.update({c: depth for c in level})
    return found


@pytest.mark.slow
@pytest.mark.parametrize("job", list(JOBS))
def test_the_workers_fork_from_their_agents_own_server_and_a_stop_leaves_nothing(tmp_path, job):
    """dlaunch -> its warm server -> an agent (forked) -> the agent's server (forked: one thread, the same command
    line) -> the worker (forked). SIGTERM to dlaunch stops the run as a stop; none of them outlives it."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command(*JOBS[job], "trainer.steps=1000000", f"hydra.run.dir={run_dir}"), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = 2 if job.startswith("emulated") else 3  # chief, worker and ps
    seen: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 120
        while len(worker_pids(run_dir) if ranks == 2 else [1 for d in seen.values() if d == 4]) < ranks:
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks should be training"
            time.sleep(0.5)
            seen = descendants(proc.pid)
        time.sleep(1)
        seen = descendants(proc.pid)
        workers = [pid for pid, depth in seen.items() if depth == 4]
        assert len(workers) == ranks and not any(depth > 4 for depth in seen.values()), seen
        for worker in workers:
            own_server = process_state(worker)[1]
            agent = process_state(own_server)[1]
            warm_server = process_state(agent)[1]
            assert threads(own_server) == 1 and threads(agent) > 1  # a server runs no thread; an elastic agent does
            assert cmdline(worker) == cmdline(own_server) == cmdline(agent) == cmdline(warm_server)  # forks, not fresh
            assert b"multiprocessing.forkserver" in cmdline(worker)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, out[-3000:]
    assert summary(run_dir)["status"] == "stopped", out[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in seen if alive(pid)], "left running after dlaunch ended"


def test_an_agent_with_a_thread_running_starts_its_workers_fresh(monkeypatch):
    """A fork copies only the forking thread: a lock another one held stays held in the child. An agent with a
    second thread therefore forks no server, and its workers start as fresh interpreters."""
    monkeypatch.setattr(agent_server, "_forked_agent", True)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert agent_server.start() is False and not agent_server.started()
    finally:
        stop.set()
        other.join()


def test_a_process_that_is_not_a_forked_agent_forks_no_server():
    """dlaunch itself, a fresh agent (launch.warm_workers=false, a CUDA node), a test: never."""
    assert agent_server.start() is False and not agent_server.started()


@pytest.mark.slow
def test_a_killed_agent_server_is_replaced_and_the_restarted_workers_finish_the_run(tmp_path):
    """Node 1's own server SIGKILLed while its worker is inside step 3: the worker dies with it (its parent-death
    signal), node 1's agent restarts the job's workers from a server multiprocessing starts in its place (fresh,
    and guarded as dlaunch's: warm.PRELOAD), the run completes from its checkpoint, and nothing is left running."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "strategy=multi_worker_mirrored", "cluster=2x1", "launch.max_restarts=1", "trainer.steps=12",
                 "trainer.checkpoint.every_steps=2", "+recipe.pause_replica=1", "+recipe.pause_step=3",
                 "+recipe.step_sleep=0.5")
    try:
        paused = run_dir / "paused-replica1"
        wait_for(lambda: paused.exists() and paused.read_text().strip(), STARTUP_S, "replica 1 to pause in step 3")
        worker = int(paused.read_text())
        own_server = process_state(worker)[1]
        assert threads(own_server) == 1 and cmdline(own_server) == cmdline(process_state(own_server)[1])  # the agent's fork
        os.kill(own_server, signal.SIGKILL)
        wait_for(lambda: worker_pids(run_dir).get(1, worker) != worker, STARTUP_S, "replica 1 to restart")
        replacement = process_state(worker_pids(run_dir)[1])[1]
        assert b"launcher.launch.forkserver_guard" in cmdline(replacement)  # imports the guard first, as dlaunch's
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert summary(run_dir)["status"] == "completed" and summary(run_dir)["restarts"] == 1, out[-3000:]
    wait_for(lambda: run_processes(run_dir) == [], 30, "the run's processes to end")
