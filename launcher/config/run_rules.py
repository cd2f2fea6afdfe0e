"""The rules across a run's sections: cluster and strategy against the batch, the input, the devices and the backend.

Each rule takes the ``RunSpec`` and the number of CUDA devices here, and raises ``PlanError`` naming the key
to change; ``RunSpec`` checks them in order (launcher/config/schema.py), with the strategy's own rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.cluster import address
from launcher.config.base import PlanError
from launcher.config.trainer import accumulation_divides, best_is_evaluated, strategy_trains_so
from launcher.input.auto_shard import too_few_files

if TYPE_CHECKING:
    from launcher.config.schema import RunSpec


def fixed_port(spec: RunSpec, cuda: int) -> None:
    c = spec.cluster
    if c.nodes > 1 and c.node_rank is not None and c.master_port == 0:
        raise PlanError(
            "cluster.master_port", 0,
            f"cluster {c.shape} with cluster.node_rank={c.node_rank}: every node must meet at the same "
            f"address, so give a port (e.g. cluster.master_port=29500)",
        )


def master_here(spec: RunSpec, cuda: int) -> None:
    """Without ``cluster.node_rank`` (or a task list) every node runs on this machine, and the rendezvous listens at
    ``cluster.master_addr``: it must be an address of this machine."""
    c = spec.cluster
    if c.node_rank is not None or c.tasks or c.loopback:
        return
    why = address.not_here(c.master_addr)
    if why:
        apart = ("give cluster=tasks with each machine's cluster.task" if c.ps
                 else "start each with its cluster.node_rank")
        raise PlanError("cluster.master_addr", c.master_addr,
                        f"{why}; with cluster {c.shape} and no cluster.node_rank every process runs on this machine and "
                        f"listens there: use 127.0.0.1, or on real machines {apart}")


def recipe_supports(spec: RunSpec, cuda: int) -> None:
    declared = spec.recipe.strategies
    if declared and spec.strategy.name not in declared:
        raise PlanError(
            "strategy", spec.strategy.name,
            f"recipe {spec.recipe.name} declares strategies {', '.join(declared)}; {spec.strategy.name} is not among them "
            f"(to run it anyway: 'recipe.strategies=[{spec.strategy.name}]')",
        )


def batch_divides(spec: RunSpec, cuda: int) -> None:
    n, gbs = spec.num_replicas, spec.input.global_batch_size
    if gbs % n:
        raise PlanError(
            "input.global_batch_size", gbs,
            f"cluster {_replicas_of(spec)} = {n} replicas, but global_batch_size {gbs} is not divisible by {n} "
            f"(try {nearby_multiples(gbs, n)})",
        )


def _replicas_of(spec: RunSpec) -> str:
    """What the replicas are: the cluster's shape, but a parameter-server cluster's chief and workers alone (its ps
    tasks hold variables)."""
    c = spec.cluster
    return f"chief + {c.workers} worker(s) (its {c.ps} ps task(s) hold variables)" if c.ps else c.shape


def nearby_multiples(value: int, n: int) -> str:
    """The multiples of ``n`` either side of ``value``: ``50 or 52`` for 51 and 2."""
    below, above = value - value % n, value + n - value % n
    return f"{below} or {above}" if below > 0 else str(above)


def no_batch(rows: int, global_batch_size: int, multiple: int, what: str = "the training data") -> str:
    """Why ``rows`` of training data (``what``) give no step a batch under input.drop_remainder=true, and what to
    change: ``the 3000 rows of the training data are fewer than one global batch (input.global_batch_size=4000) ...``."""
    if rows == 0:
        return f"{what} hold no rows"
    fits = rows - rows % multiple
    smaller = f"input.global_batch_size={fits} or less" + (
        f" (a multiple of {multiple}: replicas x trainer.grad_accum_steps)" if multiple > 1 else "") if fits else ""
    return (f"the {rows} rows of {what} are fewer than one global batch (input.global_batch_size={global_batch_size}), "
            "and input.drop_remainder=true drops a partial batch: no step would have a batch; use "
            f"{smaller + ', or ' if smaller else ''}input.drop_remainder=false (the {rows} rows are one batch)")


def whole_batches(spec: RunSpec, cuda: int) -> None:
    """A last partial global batch splits unevenly over the replicas (or leaves some none): dlaunch's loop weights
    each replica's mean loss by its rows (launcher/runtime/step.py), so it trains as one device does; a strategy
    with a loop of its own may not (a manual step neither: config/recipe_rules.py)."""
    if spec.num_replicas == 1 or spec.input.drop_remainder:
        return
    why = spec.strategy.refusal("partial-batches", spec)
    if why:
        raise PlanError("input.drop_remainder", False,
                        f"with {spec.num_replicas} replicas a last partial global batch leaves some replicas short or "
                        f"empty, and {why}")


def files_cover_workers(spec: RunSpec, cuda: int) -> None:
    if spec.input.auto_shard_policy != "FILE":
        return
    files, workers = len(spec.input.files), spec.num_processes
    if files == 0:
        raise PlanError(
            "input.auto_shard_policy", "FILE",
            "FILE shards input.files across workers, but input.files is not set; set input.files or use AUTO, DATA or OFF",
        )
    if files < workers:
        raise PlanError(
            "input.auto_shard_policy", "FILE",
            f"input.files matched {too_few_files(files, workers)} (cluster {spec.cluster.shape} = {workers} worker processes)",
        )


def strategy_device_exists(spec: RunSpec, cuda: int) -> None:
    for key, device in spec.strategy.named_devices():
        if device.startswith("cuda") and int(device.split(":")[1]) >= cuda:
            raise PlanError(key, device, f"{device} was asked for, but this machine has {cuda} CUDA device(s)")


def devices_exist(spec: RunSpec, cuda: int) -> None:
    if spec.device_type(cuda) != "cuda":
        return
    if cuda == 0:
        from launcher.cluster import gpus

        why = gpus.driver_too_old()  # asked here alone: a worker never gets this far with no device
        raise PlanError("cluster.device", "cuda", f"cuda was asked for, but {why}; or use cluster.device=cpu" if why else
                        "cuda was asked for, but no CUDA device is visible; use cluster.device=cpu")
    wanted = spec.cluster.devices_per_node
    if wanted > cuda:
        raise PlanError(
            "cluster.devices_per_node", wanted,
            f"cluster {spec.cluster.shape} asks for {wanted} CUDA devices per node, but this machine has {cuda}",
        )
    if spec.cluster.emulated and spec.cluster.world_size > cuda:  # each emulated node gets GPUs of its own
        raise PlanError(
            "cluster.nodes", spec.cluster.nodes,
            f"cluster {spec.cluster.shape} emulates {spec.cluster.nodes} nodes on this machine, one CUDA device per "
            f"process: {spec.cluster.nodes} x {wanted} = {spec.cluster.world_size}, but this machine has {cuda}; set "
            "cluster.node_rank on each real node, or ask for fewer",
        )


def backend_fits(spec: RunSpec, cuda: int) -> None:
    if spec.backend(cuda) == "nccl" and spec.device_type(cuda) != "cuda":
        raise PlanError("cluster.backend", "nccl", "nccl needs CUDA devices; use cluster.backend=gloo (or auto) on CPU")


# dlaunch's loop's rules (batch, input, trainer): a script brings its own loop, so they are not checked for it.
# trainer.precision reaches a script too (strategy.autocast()): precision_runs_here holds for it, and script_fits
# refuses fp16-mixed where the strategy does.
LOOP_RULES = (recipe_supports, batch_divides, whole_batches, files_cover_workers, accumulation_divides,
              strategy_trains_so, best_is_evaluated)
# the rules that count replicas or processes: not judged while the strategy's shape rules refuse the cluster's shape
SHAPE_DEPENDENT = (batch_divides, whole_batches, files_cover_workers, accumulation_divides)
