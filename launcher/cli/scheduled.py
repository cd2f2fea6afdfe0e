"""Jobs run by a scheduler through hydra-submitit-launcher (``hydra/launcher=submitit_slurm``).

``cluster=NxM`` becomes the allocation: N SLURM nodes with one task each (each
task is one dlaunch node and starts M workers through its elastic agent), and M
GPUs per node when the cluster's device is CUDA. With ``submitit_local`` the N
tasks run on this machine, each as one node. Inside a task the node rank and the
master address come from the scheduler's variables (``launcher.cluster.scheduler``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

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


def _given(overrides: list[str], prefix: str = "hydra.launcher.") -> dict[str, str]:
    found = {}
    for text in overrides:
        key, _, value = text.partition("=")
        if key.lstrip("+").startswith(prefix):
            found[key.lstrip("+").removeprefix(prefix)] = value
    return found


def resources(launcher: str, spec: Any, device: str = "cuda") -> dict[str, int]:
    """submitit's resources for one job of this cluster, whose nodes run on ``device`` (see ``slurm.device``)."""
    c = spec.cluster
    if launcher == "submitit_local":  # one machine: each node is a task here, with GPUs of its own (scheduler.placed)
        local = {"nodes": 1, "tasks_per_node": c.nodes}
        # submitit's local executor shows a task only the GPUs asked for: none unless this is set
        return {**local, "gpus_per_node": c.nodes * c.devices_per_node} if device == "cuda" else local
    wanted = {"nodes": c.nodes, "tasks_per_node": 1}
    if device == "cuda":
        wanted["gpus_per_node"] = c.devices_per_node
    return wanted


def _here(spec: Any) -> str:
    """The device a submitit_local job's tasks run on: this machine's, as its plan resolves it."""
    from launcher.cluster import gpus

    return spec.device_type(gpus.count())


def _one(launcher: str, what: str, values: set[str]) -> None:
    if len(values) > 1:
        raise ConfigError([Problem(key=what, value=",".join(sorted(values)), message=(
            f"hydra/launcher={launcher} runs a sweep as one job array with one allocation shape; "
            f"sweep {what} in separate commands"))])


def _slurm_choice(specs: list[Any], partition: str | None, query: Callable[[], Any] | None) -> tuple[str, str, Any]:
    """The device the jobs' nodes run on, why, and the partition as sinfo has it (None: unknown); ``slurm.device``."""
    from launcher.cli import slurm

    info = (query or slurm.sinfo)()
    decided = [slurm.device(s, info, partition) for s in specs]
    _one("submitit_slurm", "cluster.device", {d for d, _ in decided})
    return (*decided[0], info.get(partition))


def resource_overrides(launcher: str, overrides: list[str], specs: list[Any], query: Callable[[], Any] | None = None) -> list[str]:
    """``hydra.launcher.*`` overrides that give the scheduler the cluster's shape; raise on a conflict.

    ``query`` stands in for sinfo (tests).
    """
    return _request(launcher, overrides, specs, query)[0]


def submission(launcher: str, overrides: list[str], specs: list[Any], query: Callable[[], Any] | None = None) -> list[str] | None:
    """The overrides to submit with (``resource_overrides``); None after a dry run on SLURM, which submits nothing.

    A dry run on SLURM shows the request and the first job's plan here: a job submitted only to print its plan
    would wait in the queue and print it in a log on the compute node.
    """
    extra, device = _request(launcher, overrides, specs, query)
    if launcher != "submitit_slurm" or not specs or not all(s.launch.dry_run for s in specs):
        return extra
    from launcher.cli import output
    from launcher.cli.plan import show_plan
    from launcher.config.plan import Plan

    sweep_dir = Path(_given(overrides, "hydra.sweep.").get("dir") or "multirun/<date>/<time>")
    cuda = specs[0].cluster.devices_per_node if device == "cuda" else 0
    show_plan(specs[0], Plan.resolve(specs[0], cuda), sweep_dir / "0", output.results(), dry_run=True)
    output.results().print(f"launch.dry_run=true: nothing was submitted ({len(specs)} job(s) would be)")
    return None


def _request(launcher: str, overrides: list[str], specs: list[Any], query: Callable[[], Any] | None) -> tuple[list[str], str]:
    """The overrides to add and the device the jobs' nodes run on; SLURM's request is checked and shown."""
    _one(launcher, "cluster", {s.cluster.shape for s in specs})
    if not specs:
        return [], ""
    given = _given(overrides)
    slurm_run = launcher == "submitit_slurm"
    device, why, partition = _slurm_choice(specs, given.get("partition"), query) if slurm_run else (_here(specs[0]), "", None)
    wanted = resources(launcher, specs[0], device)
    problems = [
        Problem(key=f"hydra.launcher.{k}", value=given[k], message=f"cluster {specs[0].cluster.shape} needs {k}={v}; leave it to dlaunch")
        for k, v in wanted.items() if k in given and str(given[k]) != str(v)
    ]
    if problems:
        raise ConfigError(problems)
    if not slurm_run:
        log.info("%s: %s", launcher, ", ".join(f"{k}={v}" for k, v in wanted.items()))
        return [f"hydra.launcher.{k}={v}" for k, v in wanted.items() if k not in given], device
    from launcher.cli import output, slurm
    from launcher.cli.plan import rows_table

    added = {k: v for k, v in {**wanted, **slurm.cpus_per_task(specs[0], device, partition)}.items() if k not in given}
    params = {**slurm.queue_defaults(), **given, **added}
    problems = slurm.fits(params, specs[0], partition)
    if problems:
        raise ConfigError(problems)
    slurm.check_on_cpu(specs, device, why)
    rows = slurm.request_rows(params, why, specs[0].cluster.devices_per_node, len(specs), partition and partition.name)
    output.results().print(rows_table("SLURM request (hydra/launcher=submitit_slurm)", rows))
    slurm.submit_with_one_screen_refusals()
    return [f"hydra.launcher.{k}={v}" for k, v in added.items()], device


def placed(spec: Any) -> Any:
    """The spec with this scheduler task's node rank and master address (unchanged outside a scheduler)."""
    try:
        cluster = placed_cluster(spec.cluster)
    except PlacementError as exc:
        raise ConfigError([Problem(key="hydra.launcher.tasks_per_node", message=str(exc), has_value=False)]) from None
    return spec if cluster is spec.cluster else spec.model_copy(update={"cluster": cluster})


