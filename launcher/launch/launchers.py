"""How a run's processes start: one small interface, one class per way, chosen once.

The strategy names its launcher (``StrategyUnit.launcher``): ``in_process`` (one
process, no restarts: train here), ``elastic`` (this node's torch.distributed.elastic
agent and workers), ``emulated`` (every node's agent on this machine) or ``tasks``
(parameter_server: one agent per task). ``choose`` is the one lookup::

    code = choose(spec).launch(spec, plan, run_dir, console)
"""

from __future__ import annotations

import abc
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("dlaunch")


class Launcher(abc.ABC):
    """Starts a validated run, waits for it, and returns its exit code (0, 1, or 128+signal)."""

    @abc.abstractmethod
    def launch(self, spec: Any, plan: Any, run_dir: Path, console: Any) -> int:
        """Run ``spec`` as ``plan`` resolved it, writing into ``run_dir``."""


class InProcess(Launcher):
    """One process (one replica, or central storage's replica threads) needs no workers: train here.

    With ``launch.max_restarts`` the strategy asks for ``elastic`` instead, so that the one worker can be restarted.
    """

    def launch(self, spec: Any, plan: Any, run_dir: Path, console: Any) -> int:
        from launcher.cluster.env import DEVICE_VARIABLE, worker_env_set
        from launcher.launch import failures, report
        from launcher.runtime import heartbeat
        from launcher.runtime.loop import train
        from launcher.runtime.preemption import Preempted

        try:
            with worker_env_set({DEVICE_VARIABLE: plan.device_type}):  # for strategies a script builds itself
                train(spec, None, run_dir, plan, console)
            return 0
        except Preempted as exc:
            log.warning("%s", exc)
            return exc.exit_code
        except KeyboardInterrupt as exc:  # outside the loop's own handling (the build, the last evaluation)
            log.warning("stopped by %s", exc if hasattr(exc, "exit_code") else "Ctrl-C")
            return getattr(exc, "exit_code", 130)
        except Exception as exc:  # noqa: BLE001 - shown as the root cause below
            root = failures.from_exception(exc, last_step=heartbeat.progress_of(exc).get("last_step"))  # as a worker's says
            report.show_root_cause(root, [], run_dir, console)
            report.record_failure(spec, run_dir, root)
            return root.exit_status


class _Workers(Launcher):
    """Worker processes that read the job file: written once here, then started by ``start``."""

    def launch(self, spec: Any, plan: Any, run_dir: Path, console: Any) -> int:
        from launcher.launch import elastic

        job = elastic.write_job(spec, run_dir, plan)
        exposed = elastic.network_binding(spec)
        if exposed:
            log.info("%s", exposed)
        return self.start(spec, plan, run_dir, job)

    @abc.abstractmethod
    def start(self, spec: Any, plan: Any, run_dir: Path, job: Path) -> int: ...


class ElasticProcesses(_Workers):
    """One node, or this machine's node of several (``cluster.node_rank``): its elastic agent runs here."""

    def start(self, spec: Any, plan: Any, run_dir: Path, job: Path) -> int:
        from launcher.launch import elastic

        c = spec.cluster
        run_id = f"dlaunch-{c.master_port}" if c.nodes > 1 else None  # every node must name the same run
        return elastic.run_node(spec, run_dir, job, plan, c.node_rank or 0, run_id)


class EmulatedNodes(_Workers):
    """Several nodes and no node rank: one agent process per node on this machine, meeting at one rendezvous."""

    def start(self, spec: Any, plan: Any, run_dir: Path, job: Path) -> int:
        from launcher.launch import emulate

        return emulate.run(spec, plan, run_dir, job)


class Tasks(Launcher):
    """A parameter-server job: chief, workers and ps tasks, each under its own agent (``launch/tasks.py``)."""

    def launch(self, spec: Any, plan: Any, run_dir: Path, console: Any) -> int:
        from launcher.launch import tasks

        return tasks.launch(spec, run_dir, plan)


LAUNCHERS: dict[str, type[Launcher]] = {
    "in_process": InProcess, "elastic": ElasticProcesses, "emulated": EmulatedNodes, "tasks": Tasks,
}


def choose(spec: Any) -> Launcher:
    """The launcher the spec's strategy names for its cluster."""
    return LAUNCHERS[spec.strategy.launcher(spec)]()
