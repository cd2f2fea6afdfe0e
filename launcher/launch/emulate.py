"""Several nodes on one machine: one elastic agent process per node, one rendezvous.

``dlaunch cluster=2x2`` with no ``cluster.node_rank`` starts, for each node, the
process that a real node would run (``dlaunch ... cluster.node_rank=i``): its
own ``torch.distributed.elastic`` agent and workers, meeting the others at node
0's c10d rendezvous store. Node rank, local rank and group rank are the real
ones. This parent only waits, stops the rest when one node fails, and shows
the root cause once across all nodes.

    python -m launcher.launch.emulate JOB NODE_RANK RUN_ID PORT PEERS [LISTEN_FD]   # one node's agent

or, where the job has dlaunch's warm server, the same forked from it (``launch/agents.py``).

``PEERS``: ``node:fd,...``, the read end of each other node's lifeline (``_lifelines``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

from launcher.cluster.env import emulated_node_devices
from launcher.config.plan import Plan, read_job
from launcher.config.schema import RunSpec
from launcher.launch import agents, elastic, failures, rendezvous, report
from launcher.runtime import outputs
from launcher.runtime.stop_signals import handling_stop_signals

log = logging.getLogger("dlaunch")


def failures_file(run_dir: Path, node_rank: int) -> Path:
    return run_dir / outputs.STATE_DIR / f"node-{node_rank}.failures.json"


def run(spec: RunSpec, plan: Plan, run_dir: Path, job: Path) -> int:
    """Start every node's agent here; return the job's exit code."""
    c = spec.cluster
    sock = rendezvous.bind(c.master_addr, c.master_port)  # node 0's store serves on it: the port is known up front
    port = sock.getsockname()[1]
    run_id = f"dlaunch-{uuid.uuid4().hex[:12]}"
    log.info("emulating %d nodes on this machine: one elastic agent per node%s, rendezvous on %s:%d", c.nodes, agents.how(),
             c.master_addr, port)
    procs: list[agents.Agent] = []
    cuda = plan.device_type == "cuda"
    elastic.teardown_marker(run_dir).unlink(missing_ok=True)  # an earlier command's
    with _stop_on_signals(), agents.killed_on_error(procs):
        try:
            with _lifelines(c.nodes) as lines:
                for node in range(c.nodes):
                    listen = (sock.fileno(),) if node == 0 else ()
                    peers = {n: read for n, (read, _) in lines.items() if n != node}
                    args = [str(job), str(node), run_id, str(port), ",".join(f"{n}:{fd}" for n, fd in peers.items()),
                            *map(str, listen)]
                    env = {**os.environ, **emulated_node_devices(node, c.devices_per_node)} if cuda else None
                    procs.append(agents.start(node_main, args, (*listen, lines[node][1], *peers.values()), env))
            ended: dict[int, float] = {}
            codes = _wait(procs, spec.launch.shutdown_grace_s + 10, elastic.teardown_marker(run_dir), ended)
        except _Stopped as stopped:
            _stop(procs, spec.launch.stop_grace_s + 5, stopped.signum)
            log.warning("stopped by %s; every node's workers were shut down", signal.Signals(stopped.signum).name)
            return 128 + stopped.signum
    return _outcome(spec, run_dir, codes, _lost_nodes(spec, run_dir, procs, ended))


@contextlib.contextmanager
def _lifelines(nodes: int) -> Iterator[dict[int, tuple[int, int]]]:
    """A pipe per node, whose write end only that node's agent holds (this process closes its copies once every
    agent has started): its peers, holding the read ends, see it readable (end of file) once the agent is gone,
    killed or not. That is how an agent tells a lost peer, which no restart brings back, from a failed worker."""
    lines = {node: os.pipe() for node in range(nodes)}
    try:
        yield lines
    finally:
        for fd in (fd for pair in lines.values() for fd in pair):
            os.close(fd)


def lost_peer(peers: dict[int, int]) -> Callable[[float], int | None]:
    """For one node's agent (``peers``: each other node's lifeline, read end): the first node whose agent is gone,
    waiting up to ``wait_s`` for one (a worker that failed because a peer node died may be seen first)."""
    def gone(wait_s: float = 0.0) -> int | None:
        readable = set(select.select(list(peers.values()), [], [], wait_s)[0]) if peers else set()
        return next((node for node, fd in peers.items() if fd in readable), None)

    return gone


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP to dlaunch reach every node's agent, which passes them to its workers."""
    stopping: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if not stopping:  # a second signal while the nodes stop changes nothing
            stopping.append(signum)
            raise _Stopped(signum)

    with handling_stop_signals(handler):
        yield


def _wait(procs: list[agents.Agent], grace_s: float, marker: Path, ended: dict[int, float]) -> list[int]:
    """Every node's exit code; once one fails, the others get ``grace_s`` to fail or finish on their own, then
    are torn down (``marker``: their agents take the SIGTERM as a failure's teardown, not as a stop). ``ended``
    gets the time each node's agent was seen to end by itself (not torn down)."""
    deadline = None
    while True:
        codes = [p.poll() for p in procs]  # every node polled: any() stopped at the first one running
        ended.update({node: time.time() for node, code in enumerate(codes) if code is not None and node not in ended})
        if None not in codes:
            return codes
        if deadline is None and any(code not in (None, 0) for code in codes):
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            mark_teardown(marker)
            _stop(procs, grace_s)
            return [p.returncode for p in procs]
        time.sleep(0.05)


def mark_teardown(marker: Path) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def _stop(procs: list[agents.Agent], grace_s: float, signum: int = signal.SIGTERM) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _lost_nodes(spec: RunSpec, run_dir: Path, procs: list[agents.Agent], ended: dict[int, float]) -> list[failures.RootCause]:
    """Nodes whose agent was killed (SIGKILL, a crash) before it could report: its workers went with it, and that is
    the cause the other nodes' broken collectives follow from. A node torn down by this parent is not one, nor one
    that ended on its own (a stop signal: exit 128+N; an error it reported itself)."""
    lost = []
    for node, p in enumerate(procs):
        if p.returncode is None or p.returncode >= 0 or failures_file(run_dir, node).exists() or node not in ended:
            continue
        how, rank = f"signal {signal.Signals(-p.returncode).name}", node * spec.cluster.devices_per_node
        pid = int(outputs.read_progress(run_dir, rank).get("pid") or p.pid)  # the rank's own, as its heartbeat last said
        lost.append(report.with_last_step(failures.RootCause(
            rank=rank, host=socket.gethostname(), pid=pid, exit=how, traceback="", time=ended[node],
            exception=f"node {node}'s elastic agent (pid {p.pid}) ended by {how} before it could report; its workers "
                      f"({spec.cluster.ranks_of(node)}) ended with it"), run_dir, report.last_logged_step(run_dir)))
    return lost


def _outcome(spec: RunSpec, run_dir: Path, codes: list[int], lost: list[failures.RootCause]) -> int:
    real: list[failures.RootCause] = list(lost)
    finished: list[failures.RootCause] = []
    for node in range(len(codes)):
        path = failures_file(run_dir, node)
        if path.exists():
            data = json.loads(path.read_text())
            real += [failures.RootCause(**c) for c in data["real"]]
            finished += [failures.RootCause(**c) for c in data["finished"]]
    if real or finished:
        lost_node = lost[0].rank // spec.cluster.devices_per_node if lost else None
        return report.report_failures(real, finished, spec, run_dir, lost_node=lost_node)
    signals = [c for c in codes if c >= 128]
    return max(signals) if signals else int(any(codes))


# ---------- one node's agent (a child process) ----------
def _record_failures(real: list, finished: list, spec: RunSpec, run_dir: Path, node: int) -> int:
    data = {"real": [c.as_dict() for c in real], "finished": [c.as_dict() for c in finished]}
    # whole or not at all: dlaunch reads it as soon as a task's failure is known, while other tasks may be writing theirs
    outputs.write_atomic(failures_file(run_dir, node), json.dumps(data).encode())
    return 1 if real else 0


def node_main(argv: list[str]) -> int:
    from rich.console import Console

    from launcher.runtime.progress import log_to_file, setup_logging
    from launcher.runtime.worker import die_with_launcher

    die_with_launcher()
    job_path, node, run_id, port, lines, *fd = argv
    node_rank = int(node)
    setup_logging(node_rank, Console(emoji=False, stderr=True), who="node")
    job = json.loads(Path(job_path).read_text())
    log_to_file(job.get("log_file"), node_rank, who="node")  # its restarts and warnings, beside the workers' lines
    spec, plan = read_job(job)
    spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"master_port": int(port)})})
    run_dir = Path(job["run_dir"])

    def on_failure(real: list, finished: list, spec: RunSpec, run_dir: Path) -> int:
        return _record_failures(real, finished, spec, run_dir, node_rank)

    listen_fd = agents.inherited_fd(int(fd[0])) if fd else None
    peers = {int(n): agents.inherited_fd(int(r)) for n, _, r in (pair.partition(":") for pair in lines.split(",") if pair)}
    return elastic.run_node(spec, run_dir, Path(job_path), plan, node_rank, run_id, listen_fd, on_failure,
                            lost_peer(peers))


if __name__ == "__main__":
    sys.exit(node_main(sys.argv[1:]))
