"""Start one worker process per device through torch.distributed.elastic.

This is the machinery torchrun uses: a ``LocalElasticAgent`` behind
``elastic_launch``, a c10d rendezvous (bound to the cluster's address), worker
monitoring, restarts and shutdown on failure or signal. dlaunch adds the worker
command, per-rank output tagging and the reading of failures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed import DistError, DistStoreError
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from launcher.checkpoint import layout
from launcher.cluster.env import worker_env_set, worker_environment
from launcher.cluster.interface import node_route
from launcher.config.plan import Plan
from launcher.config.schema import RunSpec
from launcher.launch import agent, agent_server, rendezvous, report, warm
from launcher.runtime import outputs, progress
from launcher.runtime.stop_signals import closing, handling_stop_signals

log = logging.getLogger("dlaunch")
WORKER_MODULE = "launcher.runtime.worker_entry"  # launcher.runtime.worker, quiet on a Ctrl-C while it imports


def write_job(spec: RunSpec, run_dir: Path, plan: Plan) -> Path:
    """The validated spec and its resolved plan, as workers read them: they never run Hydra nor resolve again.

    Nodes that share a run directory (a scheduler's tasks on a shared file system)
    each write their own job file; node 0 clears what a previous run left.
    """
    state = run_dir / outputs.STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    node = spec.cluster.node_rank
    if not node:
        # a reused run directory must not speak for this run
        for pattern in ("rank-*.done", "rank-*.progress.json", "node-*.failures.json"):
            for stale in state.glob(pattern):
                stale.unlink()
        (spec.trainer.checkpoint.root(run_dir) / layout.TIMELINE).unlink(missing_ok=True)  # this command saved nothing yet
        teardown_marker(run_dir).unlink(missing_ok=True)  # an earlier command's teardown is not this one's
    path = state / ("job.json" if node is None else f"job-node{node}.json")
    path.write_text(json.dumps({"spec": spec.model_dump(mode="json"), "plan": plan.model_dump(mode="json"),
                                "run_dir": str(run_dir.resolve()), "log_file": progress.launcher_log(),
                                "console_tag": progress.console_tag()}))
    return path


def node_config(spec: RunSpec, run_dir: Path, node_rank: int, run_id: str | None, listen_fd: int | None = None) -> LaunchConfig:
    """The elastic agent's settings for node ``node_rank`` of the spec's cluster."""
    c = spec.cluster
    config = local_config(
        c.devices_per_node, run_dir / "logs" / (f"node{node_rank}" if c.nodes > 1 else ""),
        addr=c.master_addr, port=c.master_port,
        max_restarts=spec.launch.max_restarts, join_timeout_s=spec.launch.rdzv_timeout_s,
        monitor_interval_s=spec.launch.monitor_interval_s, shutdown_grace_s=spec.launch.shutdown_grace_s,
        stop_grace_s=spec.launch.stop_grace_s, teardown_marker=teardown_marker(run_dir), nodes=c.nodes,
        node_rank=node_rank, run_id=run_id, listen_fd=listen_fd, local_addr=_local_addr(spec, node_rank),
    )
    config.dlaunch_run_dir, config.dlaunch_wait_note_s = run_dir, spec.launch.collective_timeout_s
    return config


teardown_marker = outputs.teardown_marker


def _local_addr(spec: RunSpec, node_rank: int) -> str | None:
    """The address other nodes reach this one at (node 0's is the master's); None: this host's name."""
    c = spec.cluster
    hosts = c.node_hosts()
    if hosts:
        return hosts[node_rank]
    if node_rank == 0 or c.loopback:
        return c.master_addr
    route = node_route(c.master_addr)
    return route.address if route else None


def local_config(
    nproc: int, log_dir: Path, *, addr: str = "127.0.0.1", port: int = 0, max_restarts: int = 0,
    join_timeout_s: int = 120, monitor_interval_s: float = 0.1, shutdown_grace_s: int = 5, stop_grace_s: int = 25,
    teardown_marker: Path | None = None, nodes: int = 1, node_rank: int | None = None, run_id: str | None = None,
    listen_fd: int | None = None,
    local_addr: str | None = "127.0.0.1", label: str | None = None,
) -> LaunchConfig:
    """``nproc`` workers of node ``node_rank`` (of ``nodes``), rendezvous on ``addr:port`` (0: a free port).

    Node 0 hosts the rendezvous store (on ``listen_fd`` if that socket is already
    bound); the other nodes connect to it.
    """
    first_tagged = 1 if not node_rank and label is None else 0  # rank 0 keeps the terminal (its progress bar)
    others = {r: Std.ALL for r in range(first_tagged, nproc)}
    rdzv = {"join_timeout": join_timeout_s, "last_call_timeout": 1, "is_host": not node_rank}
    if node_rank is not None:
        rdzv["node_rank"] = node_rank
    if listen_fd is not None:
        rdzv["listen_fd"] = listen_fd
    config = LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=nproc,
        run_id=run_id or f"dlaunch-{uuid.uuid4().hex[:12]}",
        role="rank",
        rdzv_backend=rendezvous.register(),
        rdzv_endpoint=f"{addr}:{port}",
        rdzv_configs=rdzv,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval_s,
        start_method="spawn",
        # The other ranks are tagged on the terminal and kept in logs/.
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=others, tee=others),
        log_line_prefix_template=f"[{label}] " if label else "[rank${rank}] ",
        local_addr=local_addr,
        **({"shutdown_timeout": shutdown_grace_s} if _HAS_SHUTDOWN_TIMEOUT else {}),
    )
    config.dlaunch_grace_s = shutdown_grace_s  # where torch has no shutdown_timeout, agent.Agent still bounds the stop
    config.dlaunch_stop_grace_s = stop_grace_s  # a stop signal's: the workers save a checkpoint before they exit
    config.dlaunch_teardown_marker = teardown_marker  # while it exists, a SIGTERM is a failure's teardown, not a stop
    config.dlaunch_lost_peer = None  # an emulated node's check for a peer agent that is gone (run_node sets it)
    config.dlaunch_run_dir = None  # where a job's ranks leave completion markers (node_config sets it)
    config.dlaunch_wait_note_s = 300.0  # how often ranks that wait on one that has not finished are named
    return config


# torch 2.11 has no LaunchConfig.shutdown_timeout (2.12 and later have it); dlaunch supports both.
_HAS_SHUTDOWN_TIMEOUT = "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


def _quiet_agent() -> None:
    """The agent logs each failure itself, and stopping the other workers (warm ones: torch.multiprocessing's
    "Terminating process N via signal SIGTERM"); dlaunch reports the root cause once instead."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing.spawn")
    names = [n for n in logging.Logger.manager.loggerDict if n.startswith(prefixes)]
    for name in (*prefixes, *names):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(spec: RunSpec, run_dir: Path, cuda_devices: int) -> int:
    """Run the job's workers to the end through the launcher its strategy names; return the exit code."""
    from launcher.launch import launchers

    return launchers.choose(spec).launch(spec, Plan.resolve(spec, cuda_devices), run_dir, None)


def network_binding(spec: RunSpec) -> str | None:
    """Why this node listens on a network address rather than loopback; None when it keeps to loopback."""
    c = spec.cluster
    if c.loopback:
        return None
    why = "cluster.tasks names hosts on the network" if c.tasks else f"cluster.master_addr={c.master_addr} names a network address"
    collectives = "the workers' collectives (gloo/NCCL) listen on this machine's network interface"
    if c.node_rank:
        return f"{collectives}, not loopback, because {why}"
    return f"the rendezvous listens on {c.master_addr}:{c.master_port or '<free port>'} and {collectives}, because {why}"


def run_node(
    spec: RunSpec, run_dir: Path, job: Path, plan: Plan, node_rank: int, run_id: str | None,
    listen_fd: int | None = None, on_failure: Callable[..., int] = report.report_failures,
    lost_peer: Callable[[float], int | None] | None = None,
) -> int:
    """This node's agent and workers, to the end; failures go to ``on_failure(real, finished, spec, run_dir)``.
    ``lost_peer``: an emulated node's peer whose agent is gone (None: none), after which no restart can help."""
    config = node_config(spec, run_dir, node_rank, run_id, listen_fd)
    config.dlaunch_lost_peer = lost_peer
    where = f" on node {node_rank} of {spec.cluster.nodes}" if spec.cluster.nodes > 1 else ""
    # the user's words, not the module's: what it is, and the key that turns it off (docs/TROUBLESHOOTING.md)
    how = (" (forked from a process that imported torch while dlaunch planned, to start sooner; "
           "launch.warm_workers=false starts fresh interpreters)") if warm.serves() else ""
    log.info("starting %d worker process(es)%s through torch.distributed.elastic%s", config.nproc_per_node, where, how)
    try:
        trace = nccl_trace_prefix(plan, run_dir)
        agent.Agent.killed.clear()
        agent.Agent.started.clear()
        with _stop_signals_raise():
            start_workers(config, WORKER_MODULE, job, single_node=spec.cluster.loopback, nccl_trace_prefix=trace,
                          master_addr=spec.cluster.master_addr)
        return 0
    except ChildFailedError as exc:
        return on_failure(*report.causes_of(exc, run_dir, spec), spec, run_dir)
    except _StoppedBeforeWorkers as exc:
        with closing():  # a second Ctrl-C now would cut this short, and the run's summary with it
            rendezvous.leave_unfinished()  # the others must not count on this node
            said = "Ctrl-C" if exc.sigval == signal.SIGINT else exc.sigval.name  # as dlaunch says it before this
            log.warning("stopped by %s before the workers started", said)
        return 128 + int(exc.sigval)
    except SignalException as exc:
        with closing():
            if teardown_marker(run_dir).exists():  # dlaunch's parent tears this node down after another node failed
                log.warning("node %d torn down after another node failed; its workers were shut down", node_rank or 0)
            elif not report.completed_before_the_stop(spec, run_dir):  # else the run completed: said after this
                killed = report.killed_on_stop(spec, run_dir, agent.Agent.killed)
                log.warning("stopped by %s; %s", exc.sigval.name, killed or "all workers were shut down")
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        log.warning("interrupted; all workers were shut down")
        return 130
    except (RendezvousError, DistError) as exc:  # DistError: torch's store said it in the rendezvous' own steps
        # a timeout is the store answering: the nodes did not meet again for a restart; anything else, once the
        # workers ran, is the store gone
        lost = agent.Agent.started and not isinstance(exc, (RendezvousTimeoutError, DistStoreError))
        said = store_lost(spec, exc) if lost else rendezvous_problem(spec, exc, again=bool(agent.Agent.started))
        return _node_failed(spec, run_dir, node_rank, exc, said)
    except OSError as exc:  # e.g. cluster.master_port already in use, an address that does not resolve
        return _node_failed(spec, run_dir, node_rank, exc, f"cannot start the rendezvous on {spec.cluster.master_addr}:"
                                                           f"{spec.cluster.master_port}: {exc}")
    finally:
        rendezvous.release_claims()  # a node started again with this node rank may claim it
        rendezvous.leave_after_failure(spec.launch.shutdown_grace_s + 5)


def _node_failed(spec: RunSpec, run_dir: Path, node_rank: int | None, exc: Exception, said: str) -> int:
    """This node failed outside its workers (the nodes never met, node 0's store went away): said, and on node 0
    recorded in the run's summary.json and error.txt as a worker's failure is there (nodes may share the directory:
    node 0 alone writes its end, and node 1's "node 0's store went away" must not replace node 0's root cause). An
    emulated node's agent leaves it to the parent, which names the lost node (exit 1)."""
    import socket
    import time

    from launcher.launch import failures

    log.error("%s", said)
    emulated = spec.cluster.nodes > 1 and spec.cluster.node_rank is None  # a child of one command's emulated nodes
    if (node_rank or 0) == 0 and not emulated:
        cause = f"{type(exc).__name__}: {said.splitlines()[0]}"
        root = failures.RootCause(0, socket.gethostname(), os.getpid(), "the node's agent", cause, "", time.time())
        report.record_failure(spec, run_dir, root, said=f"node {node_rank or 0} failed: {said}\n")
    return 1


class _StoppedBeforeWorkers(SignalException):
    """A stop signal while the nodes met (or before): torch's agent had not taken the signals over yet."""


@contextlib.contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """SIGTERM, SIGHUP and Ctrl-C stop dlaunch as torch's agent stops on them once its workers run: while the nodes
    still meet (up to launch.rdzv_timeout_s), SIGTERM's default action would kill it with no word and no summary,
    and none of them would take this node out of the rendezvous."""
    def stop(signum: int, frame: Any) -> None:
        raise _StoppedBeforeWorkers(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    with handling_stop_signals(stop, (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)):
        yield


def nccl_trace_prefix(plan: Plan, run_dir: Path) -> str | None:
    """Where an nccl job's flight recorder dumps each rank's last collectives on a timeout; None for gloo."""
    if plan.backend != "nccl":
        return None
    return str(run_dir.resolve() / outputs.STATE_DIR / "nccl_trace_rank_")


def store_lost(spec: RunSpec, exc: Exception) -> str:
    """The nodes had met and the workers ran when node 0's store went away: no rendezvous problem."""
    c = spec.cluster
    return (f"node 0's store at {c.master_addr}:{c.master_port} went away while this node's workers ran (node 0's "
            f"dlaunch ended or was killed, or the network to it dropped), so this node stopped its workers: {exc}")


def rendezvous_problem(spec: RunSpec, exc: Exception, again: bool = False) -> str:
    """Why the nodes did not meet (``again``: for a restart of the workers), naming the nodes (and their ranks) that
    never came."""
    c = spec.cluster
    why = str(exc).splitlines()[0] if str(exc).strip() else "the rendezvous timed out"
    meet = "meet again to restart the workers (launch.max_restarts)" if again else "meet"
    text = f"the nodes could not {meet} at {c.master_addr}:{c.master_port}: {why}"
    joined = rendezvous.last_joined()
    if c.nodes == 1 or joined is None:
        return text
    missing = [r for r in range(c.nodes) if r not in joined]
    if not missing:
        return text
    came = "; ".join(f"node {r}: {who}" for r, who in sorted(joined.items())) or "none"
    absent = ", ".join(f"node {r} ({c.ranks_of(r)})" for r in missing)
    counted = "".join(f"\n  node {r} came with a cluster of {n} nodes (this one: {c.nodes}), and left: every node "
                      "runs the same command, but for cluster.node_rank" for r, n in rendezvous.other_counts().items())
    return (
        f"{text}\n  joined within {spec.launch.rdzv_timeout_s} s: {came}\n  missing: {absent}; start "
        f"`dlaunch ... cluster.node_rank=N` there, with the same cluster.master_addr={c.master_addr} "
        f"and cluster.master_port={c.master_port}{counted}"
    )


def start_workers(config: LaunchConfig, module: str, job: Path, single_node: bool, nccl_trace_prefix: str | None = None,
                  extra_env: dict[str, str] | None = None, master_addr: str | None = None,
                  forked: Callable[[str], int] | None = None) -> None:
    """``python -m module job`` on every worker, under the elastic agent; raises on failure.

    ``nccl_trace_prefix``: an nccl job's flight-recorder dumps go to this prefix + rank.
    ``extra_env``: more variables for the workers (a parameter-server task's identity).
    ``master_addr``: a multi-node job's collectives use the interface whose route reaches it.
    ``forked``: ``forked(job)`` in workers forked from the running forkserver instead (``run_function``'s);
    dlaunch's own workers fork from the command's warm server (``warm.serves()``).
    """
    _quiet_agent()
    route = None if single_node or master_addr is None else node_route(master_addr)
    variables = worker_environment(single_node, nccl_trace_prefix, interface=route.interface if route else None)
    with worker_env_set({**variables, **(extra_env or {})}), agent.graceful_agent(config):
        # dlaunch's server is kept only for local CPU workers (warm.eligible); an agent forked from it forks its own
        environments = warm.environments() if forked is None and module == WORKER_MODULE and warm.serves() else ()
        if forked is None and module == WORKER_MODULE and (environments or agent_server.start()):
            from launcher.runtime.worker import run_job as forked  # imported by the forkserver already
        if forked is not None:
            config.start_method = "forkserver"  # forked from the warm server (launcher/launch/warm.py)
            elastic_launch(config, forked)(str(job), *environments)  # none: an agent's server, started in it now
        else:
            elastic_launch(config, sys.executable)("-u", "-m", module, str(job))
