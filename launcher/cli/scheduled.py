"""Jobs run by a scheduler through hydra-submitit-launcher (``hydra/launcher=submitit_slurm``).

``cluster=NxM`` becomes the allocation: N SLURM nodes with one task each (each
task is one dlaunch node and starts M workers through its elastic agent), and M
GPUs per node when the cluster's device is CUDA. With ``submitit_local`` the N
tasks run on this machine, each as one node. Inside a task the node rank and the
master address come from the scheduler's variables (``launcher.cluster.scheduler``).
"""

from __future__ import annotations

import logging
from typing import Any

from hydra.errors import CompactHydraException

from launcher.cluster.scheduler import PlacementError, placed as placed_cluster
from launcher.config.errors import ConfigError, Problem

log = logging.getLogger("dlaunch")
LAUNCHERS = ("submitit_local", "submitit_slurm")


class JobFailed(CompactHydraException):
    """A scheduled dlaunch job ended non-zero; its root cause is in the task's own log.

    Hydra prints a compact exception as one line, with no traceback.
    """


def launcher_of(overrides: list[str]) -> str | None:
    for text in overrides:
        key, _, value = text.partition("=")
        if key.lstrip("+") == "hydra/launcher" and value in LAUNCHERS:
            return value
    return None


def _given(overrides: list[str]) -> dict[str, str]:
    found = {}
    for text in overrides:
        key, _, value = text.partition("=")
        if key.lstrip("+").startswith("hydra.launcher."):
            found[key.lstrip("+").removeprefix("hydra.launcher.")] = value
    return found


def resources(launcher: str, spec: Any) -> dict[str, int]:
    """submitit's resources for one job of this cluster."""
    c = spec.cluster
    if launcher == "submitit_local":  # one machine: each node is a task here
        return {"nodes": 1, "tasks_per_node": c.nodes}
    wanted = {"nodes": c.nodes, "tasks_per_node": 1}
    if c.device != "cpu":  # cluster.device=auto on SLURM asks for GPUs; cpu asks for none
        wanted["gpus_per_node"] = c.devices_per_node
    return wanted


def resource_overrides(launcher: str, overrides: list[str], specs: list[Any]) -> list[str]:
    """``hydra.launcher.*`` overrides that give the scheduler the cluster's shape; raise on a conflict."""
    shapes = {s.cluster.shape for s in specs}
    if len(shapes) > 1:
        raise ConfigError([Problem(key="cluster", value=",".join(sorted(shapes)), message=(
            f"hydra/launcher={launcher} runs a sweep as one job array with one allocation shape; "
            "sweep cluster shapes in separate commands"))])
    if not specs:
        return []
    wanted, given = resources(launcher, specs[0]), _given(overrides)
    problems = [
        Problem(key=f"hydra.launcher.{k}", value=given[k], message=f"cluster {specs[0].cluster.shape} needs {k}={v}; leave it to dlaunch")
        for k, v in wanted.items() if k in given and str(given[k]) != str(v)
    ]
    if problems:
        raise ConfigError(problems)
    extra = [f"hydra.launcher.{k}={v}" for k, v in wanted.items() if k not in given]
    log.info("%s: %s", launcher, ", ".join(f"{k}={v}" for k, v in wanted.items()))
    return extra


def placed(spec: Any) -> Any:
    """The spec with this scheduler task's node rank and master address (unchanged outside a scheduler)."""
    try:
        cluster = placed_cluster(spec.cluster)
    except PlacementError as exc:
        raise ConfigError([Problem(key="hydra.launcher.tasks_per_node", message=str(exc), has_value=False)]) from None
    return spec if cluster is spec.cluster else spec.model_copy(update={"cluster": cluster})


