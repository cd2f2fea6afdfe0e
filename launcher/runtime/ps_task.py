"""A ps task under dlaunch: build the recipe's variables, keep this task's shards, serve until the chief is done.

Every ps task builds the model from the recipe with the run's seed (so its
values are the ones a one-device run starts from), keeps the shards the
placement gives it and drops the rest, then serves pulls, pushes and
checkpoint requests over RPC. The chief and workers never hold the values of
a whole partitioned variable.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
from pathlib import Path
from typing import Any, Iterator

import torch.distributed as dist

from launcher.cluster import rpc
from launcher.cluster.env import PSTask
from launcher.config.plan import Plan
from launcher.config.schema import RunSpec
from launcher.distribute import server as ps_server
from launcher.distribute.ps_placement import place_module
from launcher.distribute.reduce_op import ReduceOp
from launcher.runtime import outputs
from launcher.runtime import recipe as recipe_lib
from launcher.runtime.preemption import Preempted, StopRequests
from launcher.runtime.profiling import StepProfiler
from launcher.runtime.progress import log
from launcher.runtime.step import is_logged
from launcher.runtime.stop_signals import handling_stop_signals
from launcher.strategies.impl.ps_module import contents_for
from launcher.strategies.parameter_server import cluster_def


def build_variables(spec: RunSpec, run_dir: Path) -> tuple[object, object]:
    """The recipe's model and optimizer, built as a one-device run builds them (same seed, same values)."""
    from launcher.runtime.loop import seed_everything
    from launcher.runtime.train_input import file_dataset

    seed_everything(spec.trainer.seed)
    loaded = recipe_lib.load(spec.recipe.model_dump())
    ctx = recipe_lib.BuildContext(
        strategy=None, seed=spec.trainer.seed, global_batch_size=spec.input.global_batch_size,
        per_replica_batch_size=spec.per_replica_batch_size, num_replicas_in_sync=spec.num_replicas,
        run_dir=run_dir, is_chief=False, input_files=file_dataset(spec),
    )
    parts = recipe_lib.checked_parts(loaded.module.build(loaded.config, ctx), loaded.module.build)
    return parts.model, parts.optimizer


def run(spec: RunSpec, plan: Plan, task: PSTask, run_dir: Path, console: Any) -> None:
    """One task of a parameter-server job: a ps serves its variables; the chief and workers train."""
    from launcher.runtime.loop import train

    try:
        if task.type == "ps":
            serve(spec, task, run_dir)
        else:
            train(spec, None, run_dir, plan, console, task=task)
    finally:
        rpc.shutdown()


def serve(spec: RunSpec, task: PSTask, run_dir: Path) -> None:
    strategy = spec.strategy
    server = ps_server.Server(cluster_def(spec.cluster), "ps", task.index, rpc_timeout_s=strategy.rpc_timeout_s)
    model, optimizer = build_variables(spec, run_dir)
    placement = place_module(model, spec.cluster.ps, strategy.partitioner.build(spec.cluster.ps))
    contents = contents_for(task.index, model, optimizer, placement)
    del model, optimizer
    store = ps_server.local_store()
    store.create(contents, spec.num_replicas if strategy.mode == "sync" else None)
    mine = placement.on(task.index)
    log.info("%s holds %d shard(s), %.1f MiB: %s", task.name, len(mine), sum(s.nbytes for s in mine) / 2**20,
             ", ".join(s.key for s in mine) or "none")
    _checkpoint_group(spec, task)
    with _serving_through_stop_signals(task, run_dir):
        server.join()
    log.info("%s: the chief is done and every worker has left; stopping", task.name)
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def _serving_through_stop_signals(task: PSTask, run_dir: Path) -> Iterator[None]:
    """A stop signal reaches every task at once; a ps serves on, so that the chief can save the variables it holds.

    The chief ends the job after its save; if it is gone instead, dlaunch tears this task down (its agent's
    ``launch.shutdown_grace_s``, the teardown marker telling it that no save comes): nothing to say then.
    """
    def note(signum: int, frame: object) -> None:
        if outputs.teardown_marker(run_dir).exists():
            return
        log.warning("%s: %s received; serving on, so that a chief that is saving can read the variables held here "
                    "(this task ends with the job)", task.name, signal.Signals(signum).name)

    with handling_stop_signals(note):
        yield


def _checkpoint_group(spec: RunSpec, task: PSTask) -> None:
    """The ps tasks' gloo group (on the chief's store), over which they write checkpoints together."""
    store = dist.PrefixStore(f"dlaunch-ps-checkpoints/{task.attempt}", rpc.store())
    dist.init_process_group("gloo", store=store, rank=task.index, world_size=spec.cluster.ps,
                            timeout=datetime.timedelta(seconds=spec.launch.collective_timeout_s))


def train_worker(spec: RunSpec, strategy: Any, replica_step: Any, stream: Any, run_dir: Path, name: str) -> dict[str, Any]:
    """A parameter-server worker: steps on its share of the data until the chief's global step is done."""
    start = strategy.global_step
    if start:
        stream.seek_step(start)
    local = 0
    profiler = StepProfiler(spec.trainer.profile, run_dir, name.replace(":", ""), replica_step.device_type)  # worker0.*
    with StopRequests(distributed=False, torn_down=outputs.teardown_marker(run_dir).exists) as stop, profiler as prof:
        while not strategy.finished and strategy.global_step < spec.trainer.steps and not stop.agreed():
            with prof.region("dlaunch.data"):
                batch = next(stream)
            with prof.region("dlaunch.step"):
                _step(spec, strategy, replica_step, batch)
            with prof.region("dlaunch.data"):
                stream.read_ahead()  # input.prefetch: the next batch, while the device runs this step
            prof.step()
            local += 1
    strategy.extended.leave(stop.signum)
    if stop.signum:
        chief_saves = "a worker saves nothing: the chief saves the checkpoints" if spec.trainer.checkpoint.every_steps else ""
        raise Preempted(stop.signum, strategy.global_step, saved_elsewhere=chief_saves)
    log.info("%s: %d step(s) from global step %d to %d", name, local, start, strategy.global_step)
    return {"status": "completed", "task": name, "local_steps": local}


def _step(spec: RunSpec, strategy: Any, replica_step: Any, batch: Any) -> None:
    """One step of a worker. In sync mode the tasks step together, so this is global step ``global_step + 1``: at a
    step the chief logs, the worker measures its metrics too and reports them (the chief logs every task's mean)."""
    step = strategy.global_step + 1
    logged = spec.strategy.mode == "sync" and is_logged(step, spec.trainer)
    per_replica = strategy.run(replica_step, args=(batch, logged))
    if logged and not strategy.finished:  # a push the chief's end released was not a step
        strategy.extended.logged_metrics(step, strategy.reduce(ReduceOp.MEAN, per_replica, axis=None))
