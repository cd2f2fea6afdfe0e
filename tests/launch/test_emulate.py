"""Emulated nodes' agents (launcher/launch/emulate.py): a node after the first that dies is noticed, and named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.launch import elastic, emulate
from tests.conftest import process_state, summary
from tests.launch.test_restarts import STARTUP_S, finish, logged_steps, run_processes, start, wait_for, worker_pids


def test_a_later_node_that_dies_ends_the_wait_while_node_0_still_runs(tmp_path):
    """The wait polled the nodes with any(), which stopped at node 0's running agent: node 1's exit was never
    read, so the failure's grace period never began, and dlaunch waited for node 0 (300 s in torch's exit barrier)."""
    node0 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    node1 = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        started = time.monotonic()
        ended: dict[int, float] = {}
        codes = emulate._wait([node0, node1], grace_s=1.0, marker=tmp_path / "teardown", ended=ended)
        assert codes[1] == 3 and codes[0] != 0 and time.monotonic() - started < 60
        assert list(ended) == [1]  # node 0 was torn down: it did not end by itself
        assert (tmp_path / "teardown").exists()  # node 0's agent is told it is a teardown, not a stop
    finally:
        node0.kill()
        node0.wait()


def agent_pid(run_dir, node: int) -> int | None:
    """The pid of emulated node ``node``'s elastic agent for this run (2x1: node N runs rank N): its worker's parent,
    or where that is the agent's own server (``launch/agent_server.py``: one thread, where the agent runs several),
    the server's parent. A forked agent's command line is its server's, so it cannot be found by that."""
    worker = worker_pids(run_dir).get(node)
    state = process_state(worker) if worker else None
    if state is None:
        return None
    try:
        server = len(os.listdir(f"/proc/{state[1]}/task")) == 1
    except OSError:
        return None
    above = process_state(state[1]) if server else state
    return above[1] if above else None


def kill_agent_in_step_3(run_dir: Path, node: int, *overrides: str) -> tuple[subprocess.Popen, str]:
    """Emulated 2x1, node ``node``'s agent SIGKILLed while replica 1 is inside step 3; (the run, its output)."""
    proc = start(run_dir, "strategy=multi_worker_mirrored", "cluster=2x1", "cluster.device=cpu", "trainer.steps=300",
                 *overrides, "+recipe.pause_replica=1", "+recipe.pause_step=3")
    try:
        paused = run_dir / "paused-replica1"
        wait_for(lambda: paused.exists() and paused.read_text().strip() and agent_pid(run_dir, node), STARTUP_S,
                 "replica 1 to pause in step 3")
        proc.killed_pids = (agent_pid(run_dir, node), worker_pids(run_dir)[node])  # (the agent, its worker)
        os.kill(proc.killed_pids[0], signal.SIGKILL)
    finally:
        out = finish(proc)
    return proc, out


@pytest.mark.parametrize("restarts", [1])  # asserts all that 0 restarts would; the next test has the default 0
def test_a_node_whose_agent_is_killed_is_the_root_cause_not_the_rank_that_lost_it(tmp_path, restarts):
    """node 1's agent killed (its worker goes with it): rank 0's broken collective blamed rank 0 ("rank 1 has
    exited"), and with restarts node 0 started its workers again to wait for a node that could not come back, then
    said "restarts exhausted". The killed agent is named now, and node 0 is torn down, not said to be stopped."""
    run_dir = tmp_path / "run"
    proc, out = kill_agent_in_step_3(run_dir, 1, f"launch.max_restarts={restarts}")
    assert proc.returncode == 1, out[-3000:]
    assert "node 1's elastic agent" in out and "ended by signal SIGKILL before it could report" in out, out[-3000:]
    assert "worker rank 1 failed: root cause" in out and "rank 0 failed: root cause" not in out, out[-3000:]
    agent, worker = proc.killed_pids
    assert f"pid {worker} signal SIGKILL" in " ".join(out.split()), out[-3000:]  # the rank's pid, not its agent's
    assert f"elastic agent (pid {agent}) ended by signal SIGKILL" in out, out[-3000:]
    assert "restarts exhausted" not in out and "stopped by SIGTERM" not in out, out[-3000:]
    # No restart is announced that could not happen (node 0's agent sees node 1's gone), and none is counted.
    assert "restart 1 of 1" not in out and summary(run_dir)["restarts"] == 0, out[-3000:]
    if restarts:
        assert "node 1's agent is gone" in out and "no node restarted its workers" in out, out[-3000:]
        log = (run_dir / "dlaunch.log").read_text()  # in the order the terminal showed: the panel, then the line
        assert log.index("worker rank 1 failed: root cause") < log.index("node 1's agent is gone"), log[-3000:]
    wait_for(lambda: run_processes(run_dir) == [], 30, "the run's processes to end")


def test_node_0s_agent_killed_is_said_once_without_torchs_cpp_store_traces(tmp_path, monkeypatch):
    """Node 0's agent SIGKILLed takes the store with it: node 1's agent and worker each printed torch's C++ store
    warnings (`[W ...TCPStore.cpp] sendBytes failed`, ~30 `frame #N` lines each) around dlaunch's own line."""
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    run_dir = tmp_path / "run"
    proc, out = kill_agent_in_step_3(run_dir, 0)
    assert proc.returncode == 1, out[-3000:]
    assert "frame #" not in out and "TCPStore.cpp" not in out, out[-3000:]
    # node 1's agent tore its rank down: the rank neither announces a stop nor its heartbeat's lost store
    assert "SIGTERM received" not in out and "heartbeat:" not in out, out[-3000:]
    assert "node 0's store at 127.0.0.1:" in out and "went away while this node's workers ran" in out, out[-3000:]
    assert "node 0's elastic agent" in out and "ended by signal SIGKILL" in out, out[-3000:]
    wait_for(lambda: run_processes(run_dir) == [], 30, "the run's processes to end")


@pytest.mark.parametrize("agents", ["forked", "fresh"])
def test_a_node_whose_agent_is_sent_sigterm_stops_the_run_as_a_stop_not_a_failure(tmp_path, agents):
    """Preempting one machine: node 1's agent gets SIGTERM, every rank saves and stops. That is a stop (exit 143,
    its resume hint), not node 1 "ended before it could report" and a failed run. Agents forked from dlaunch's
    warm server (launcher/launch/agents.py), and fresh ones (``launch.warm_workers=false``)."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "strategy=multi_worker_mirrored", "cluster=2x1", "cluster.device=cpu", "trainer.steps=300",
                 "launch.max_restarts=1", "+recipe.step_sleep=0.05", f"launch.warm_workers={agents == 'forked'}")
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 6 and agent_pid(run_dir, 1), STARTUP_S, "six logged steps")
        os.kill(agent_pid(run_dir, 1), signal.SIGTERM)
    finally:
        out = finish(proc)
    assert proc.returncode == 143, out[-3000:]
    assert "before it could report" not in out and "root cause" not in out, out[-3000:]
    assert "resume with: dlaunch resume" in out and summary(run_dir)["status"] == "stopped", out[-3000:]
    assert ("agent per node (forked from a process that imported torch" in out) == (agents == "forked"), out[-3000:]


HUNG_SCRIPT = """\
import time, torch, torch.distributed as dist
for step in range(1, 100):
    if dist.get_rank() == 1 and step == 3:
        time.sleep(10_000)
    t = torch.ones(1); dist.all_reduce(t)
"""


def test_a_rank_that_hangs_on_another_node_is_named_once_without_cpp_traces(run_dlaunch, tmp_path):
    """Node 0's rank timed out and its agent exited with the rendezvous store while node 1's still ran: node 1's
    agent found the store gone under its hung worker, printed torch's C++ store traces (`frame #N: c10::...`) and
    "the nodes could not meet" (they had met long before), and reported none of its ranks. Now node 1 stops its
    workers before node 0's store goes, and the panel names the hung rank as it does on one node, with the line the signal found it at."""
    (tmp_path / "hang.py").write_text(HUNG_SCRIPT)
    proc, run_dir = run_dlaunch("script=hang.py", "strategy=multi_worker_mirrored", "cluster=2x1",
                                "launch.collective_timeout_s=5")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert out.count("root cause") == 1 and "Timed out waiting 5000ms" in out, out[-3000:]
    assert "rank 1: exit code 143: ScriptStopped: stopped by SIGTERM in <module> (hang.py:4)" in out, out[-3000:]
    assert "frame #" not in out and "TCPStore" not in out and "could not meet" not in out, out[-3000:]
    assert summary(run_dir)["status"] == "failed"


LATE_FAILURE_SCRIPT = """\
import time, torch, torch.distributed as dist
t = torch.ones(1); dist.all_reduce(t)
if dist.get_rank() == 1:
    time.sleep(3)
    raise ValueError("rank 1 could not write its eval file")
"""


def test_a_node_that_finished_leaves_its_wait_for_the_others_when_another_node_fails(run_dlaunch, tmp_path):
    """Node 0's rank finished while node 1's still ran: node 0's agent waits for the other nodes (torch's exit
    barrier, 300 s) and, when node 1's rank then failed, went on waiting until dlaunch tore it down. Now it waits
    however long the others run, and leaves as soon as another node failed for good."""
    (tmp_path / "late.py").write_text(LATE_FAILURE_SCRIPT)
    proc, run_dir = run_dlaunch("script=late.py", "strategy=multi_worker_mirrored", "cluster=2x1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "worker rank 1 failed: root cause" in out and "could not write its eval file" in out, out[-3000:]
    assert "frame #" not in out, out[-3000:]
    assert not elastic.teardown_marker(run_dir).exists(), "node 0 was torn down: it went on waiting for node 1"
    assert summary(run_dir)["status"] == "failed"


def test_a_restart_is_blamed_on_the_failing_rank_by_each_node(tmp_path):
    """Node 0's agent could announce the restart as `rank 0 failed (... rank 1 has exited ...)`: its rank only lost a
    peer; it says `rank 0 stopped when a rank of another node ended` now."""
    run_dir = tmp_path / "run"
    out = " ".join(finish(start(run_dir, "strategy=multi_worker_mirrored", "cluster=2x1", "cluster.device=cpu", "trainer.steps=20",
                                "launch.max_restarts=1", "+recipe.fail_replica=1", "+recipe.fail_step=3")).split())
    # node 0 says so where its rank's collective broke first (else its agent restarts for node 1's, with no line)
    assert "rank 0 failed (" not in out, out[-3000:]
    assert "rank 1 failed (exit code 1: RuntimeError: injected failure on replica 1 at step 3); restart 1 of 1" in out, out[-3000:]
    assert out.count("failed: root cause") == 1 and "restarts exhausted" in out, out[-3000:]
