"""The training loop: the runner owns it, the recipe supplies the step.

``train`` is the same for every strategy: build the strategy from the spec,
build the recipe inside ``strategy.scope()``, then call the step through
``strategy.run`` for ``trainer.steps`` global batches.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from rich.console import Console
from torch.utils.data import DataLoader, Dataset, IterableDataset

from launcher import strategies
from launcher.cluster.env import WorkerEnv
from launcher.config.schema import RunSpec
from launcher.distribute.input_context import InputOptions
from launcher.distribute.reduce_op import ReduceOp
from launcher.distribute.strategy import Strategy
from launcher.input.files import FileDataset
from launcher.runtime import heartbeat, outputs
from launcher.runtime import recipe as recipe_lib
from launcher.runtime.progress import ProgressReporter, log


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial parameters and data order."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # numpy is optional for dlaunch itself
        pass


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP or mirrored copies."""
    return getattr(model, "module", model)


def param_norm(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return math.sqrt(sum(float(p.detach().float().pow(2).sum()) for p in unwrap(model).parameters()))


def global_batches(data: Any, spec: RunSpec) -> Any:
    """A map-style dataset becomes a loader of global batches, shuffled by ``input.seed`` (default ``trainer.seed``)."""
    if isinstance(data, Dataset) and not isinstance(data, IterableDataset):
        generator = torch.Generator().manual_seed(spec.input_seed)
        return DataLoader(
            data,
            batch_size=spec.input.global_batch_size,
            shuffle=spec.input.shuffle,
            drop_last=spec.input.drop_remainder,
            num_workers=spec.input.num_workers,
            generator=generator,
        )
    return data


def file_dataset(spec: RunSpec) -> FileDataset | None:
    """The dataset ``input.files`` describes, batched and shuffled as the input section says."""
    inp = spec.input
    if not inp.files:
        return None
    dataset = FileDataset(tuple(inp.files), inp.file_format).batch(inp.global_batch_size, inp.drop_remainder)
    return dataset.shuffle(spec.input_seed) if inp.shuffle else dataset


def input_options(spec: RunSpec) -> InputOptions:
    return InputOptions(auto_shard_policy=spec.input.policy, experimental_per_replica_buffer_size=spec.input.prefetch)


def forever(dataset: Any) -> Iterator[Any]:
    """Iterate epoch after epoch (each epoch reshuffles)."""
    while True:
        empty = True
        for batch in dataset:
            empty = False
            yield batch
        if empty:
            raise ValueError(
                "the training data yields no batch: it is smaller than one global batch "
                "(lower input.global_batch_size, or set input.drop_remainder=false)"
            )


def make_replica_step(loaded: recipe_lib.LoadedRecipe, model: Any, optimizer: Any) -> Callable[[Any], torch.Tensor]:
    user_step = loaded.module.train_step
    if loaded.manual:
        def manual_step(batch: Any) -> torch.Tensor:
            return torch.as_tensor(user_step(model, batch, optimizer)).detach()

        return manual_step

    def simple_step(batch: Any) -> torch.Tensor:
        loss = user_step(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return simple_step


class _Meter:
    """Throughput between log points and over the whole run."""

    def __init__(self, global_batch: int, total_steps: int):
        self.global_batch, self.total = global_batch, total_steps
        self.start = self.mark = time.perf_counter()
        self.mark_step = 0

    def window(self, step: int) -> tuple[float, float]:
        now = time.perf_counter()
        rate = (step - self.mark_step) * self.global_batch / max(now - self.mark, 1e-9)
        per_step = (now - self.start) / max(step, 1)
        self.mark, self.mark_step = now, step
        return rate, per_step * (self.total - step)


def train(spec: RunSpec, env: WorkerEnv | None, run_dir: Path, cuda_devices: int, console: Console | None = None) -> dict[str, Any]:
    """Run the recipe under the spec's strategy; rank 0 writes metrics and the summary."""
    started = time.perf_counter()
    rank = env.rank if env else 0
    chief = rank == 0
    runtime = strategies.Runtime(env, spec.device_type(cuda_devices), spec.backend(cuda_devices), spec.launch.collective_timeout_s)
    seed_everything(spec.trainer.seed)
    strategy = strategies.build(spec.strategy, runtime)
    loaded = recipe_lib.load(spec.recipe.model_dump())
    ctx = recipe_lib.BuildContext(
        strategy=strategy, seed=spec.trainer.seed, global_batch_size=spec.input.global_batch_size,
        per_replica_batch_size=spec.per_replica_batch_size, num_replicas_in_sync=strategy.num_replicas_in_sync,
        run_dir=run_dir, is_chief=chief, input_files=file_dataset(spec),
    )
    with strategy.scope():
        parts = loaded.module.build(loaded.config, ctx)
        model, optimizer = strategy.prepare(parts.model, parts.optimizer)
    log.info("%s: %d replica(s) in sync on %s", type(strategy).__name__, strategy.num_replicas_in_sync, ", ".join(strategy.extended.worker_devices))

    batches = forever(strategy.experimental_distribute_dataset(global_batches(parts.train_data, spec), input_options(spec)))
    loop_started = time.perf_counter()
    with heartbeat.start(env, run_dir, spec.launch.collective_timeout_s) as watch:
        losses = _run_steps(spec, strategy, make_replica_step(loaded, model, optimizer), batches, run_dir, chief, console, watch)
    loop_seconds = time.perf_counter() - loop_started

    metrics = {}
    evaluate = loaded.evaluate()
    if chief and evaluate is not None:
        with torch.no_grad():
            metrics = {k: float(v) for k, v in evaluate(unwrap(model), parts).items()}
        log.info("eval: %s", ", ".join(f"{k}={v:.6g}" for k, v in metrics.items()))
    summary = {
        "status": "completed",
        "strategy": spec.strategy.name,
        "recipe": spec.recipe.name,
        "cluster": spec.cluster.shape,
        "device": runtime.device_type,
        "backend": runtime.backend if strategy.num_replicas_in_sync > 1 else None,
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "world_size": env.world_size if env else 1,
        "global_batch_size": spec.input.global_batch_size,
        "per_replica_batch_size": spec.per_replica_batch_size,
        "steps": spec.trainer.steps,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "examples_per_sec": spec.trainer.steps * spec.input.global_batch_size / loop_seconds,
        "wall_seconds": time.perf_counter() - started,
        "param_norm": param_norm(model),
        "metrics": metrics,
    }
    if chief:
        outputs.write_json_atomic(run_dir / outputs.SUMMARY, summary)
    return summary


def _run_steps(spec: RunSpec, strategy: Strategy, replica_step: Callable, batches: Iterator[Any], run_dir: Path, chief: bool, console: Console | None,
               watch: heartbeat.Heartbeat) -> list[float]:
    steps, every = spec.trainer.steps, spec.trainer.log_every
    progress = ProgressReporter(steps, enabled=chief, console=console or Console(stderr=True))
    metrics_log = outputs.MetricsLog(run_dir / outputs.METRICS) if chief else None
    meter = _Meter(spec.input.global_batch_size, steps)
    losses: list[float] = []
    try:
        for step in range(1, steps + 1):
            with watch.step(step):
                per_replica = strategy.run(replica_step, args=(next(batches),))
            if step == 1 or step % every == 0 or step == steps:
                with watch.operation(f"loss reduce at step {step}"):
                    loss = float(strategy.reduce(ReduceOp.MEAN, per_replica, axis=None))
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss} at step {step}; lower recipe.optimizer.lr or check the data")
                losses.append(loss)
                rate, eta = meter.window(step)
                progress.logged(step, loss, rate, eta)
                if metrics_log:
                    metrics_log.write({"step": step, "loss": loss, "examples_per_sec": rate, "time": time.time()})
            else:
                progress.advance(step)
    finally:
        progress.close()
        if metrics_log:
            metrics_log.close()
    return losses
