"""The training loop: the runner owns it, the recipe supplies the step.

``train`` is the same for every strategy: build the strategy from the spec,
build the recipe inside ``strategy.scope()``, then call the step (``step.py``:
precision, accumulation, clipping) through ``strategy.run`` for ``trainer.steps``
global batches, stepping the learning-rate schedule after each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from rich.console import Console

from launcher import checkpoint, strategies
from launcher.checkpoint import Checkpointer, weights
from launcher.checkpoint.state import unwrap
from launcher.cluster.env import PSTask, WorkerEnv
from launcher.config.plan import Plan
from launcher.config.schema import RunSpec
from launcher.distribute import activation_checkpointing
from launcher.distribute.dtensors import param_norm
from launcher.distribute.reduce_op import ReduceOp
from launcher.distribute.strategy import Strategy
from launcher.input.position import DataStream
from launcher.runtime import heartbeat, outputs, recipe as recipe_lib, train_input
from launcher.runtime.train_input import file_dataset
from launcher.runtime.compiled import compile_model
from launcher.runtime.evaluation import Evaluator, said
from launcher.runtime.loggers import make_loggers
from launcher.runtime.preemption import Preempted, StopRequests, StoppedEarly
from launcher.runtime.profiling import StepProfiler
from launcher.runtime.progress import Meter, ProgressReporter, log
from launcher.runtime.schedule import current_lr, make_schedule
from launcher.runtime.divergence import (LossNotFinite, grad_norm_not_finite, loss_not_finite, parameters_diverged,
                                         parameters_not_finite)
from launcher.runtime.step import NOT_MEASURED, ReplicaStep, is_logged, loop_state, restore_loop_state, warn_if_all_skipped


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial parameters and data order."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)


def train(spec: RunSpec, env: WorkerEnv | None, run_dir: Path, plan: Plan, console: Console | None = None,
          task: PSTask | None = None) -> dict[str, Any]:
    """Run the recipe under the spec's strategy; rank 0 (the chief) writes metrics and the summary.

    Resumes from ``trainer.resume``'s checkpoint when there is one, saves every
    ``trainer.checkpoint.every_steps``, and on SIGTERM/SIGINT/SIGHUP saves and
    raises ``Preempted``. ``task``: this process's task in a parameter-server job.
    With ``script=PATH`` the user's script replaces the recipe and this loop (``script.py``).
    """
    if spec.script is not None:
        from launcher.runtime import script

        return script.run(spec, env, run_dir, plan, console)
    started = time.perf_counter()
    rank = env.rank if env else (task.rank if task else 0)
    runtime = strategies.Runtime(env, plan.device_type, plan.backend, spec.launch.collective_timeout_s,
                                 run_spec=spec, task=(task.type, task.index) if task else None)
    seed_everything(spec.trainer.seed)
    strategy = strategies.build(spec.strategy, runtime)
    loaded = recipe_lib.load(spec.recipe.model_dump())
    ctx = recipe_lib.BuildContext(
        strategy=strategy, seed=spec.trainer.seed, global_batch_size=spec.input.global_batch_size,
        per_replica_batch_size=spec.per_replica_batch_size, num_replicas_in_sync=strategy.num_replicas_in_sync,
        run_dir=run_dir, is_chief=rank == 0, input_files=file_dataset(spec),
    )
    with strategy.scope():
        parts = recipe_lib.checked_parts(loaded.module.build(loaded.config, ctx), loaded.module.build)
        _check_built(parts, ctx, spec, strategy)
        model, optimizer = strategy.prepare(parts.model, parts.optimizer)
    log.info("%s: %d replica(s) in sync on %s", type(strategy).__name__, strategy.num_replicas_in_sync, ", ".join(strategy.extended.worker_devices))
    compile_model(model, spec.trainer.compile)
    step = ReplicaStep(loaded.module.train_step, model, optimizer, spec.trainer, strategy.extended.device_type, loaded.manual)
    stream = DataStream(train_input.distributed(strategy, parts.train_data, spec), spec.input.global_batch_size,
                        spec.input.prefetch, spec.num_replicas * spec.trainer.grad_accum_steps)
    own = strategy.extended.own_loop()
    if own is not None:
        return own(spec, strategy, step, stream, run_dir)
    evaluator = Evaluator(loaded.evaluate(), model, parts, step, rank == 0, strategy.extended.collective_forward)
    checkpointer = Checkpointer(spec, run_dir, rank, strategy.extended, parts.objects)
    loop = _Loop(spec, strategy, model, optimizer, stream, checkpointer, run_dir, rank == 0, console, step,
                 make_schedule(spec.trainer, optimizer), evaluator, StepProfiler(spec.trainer.profile, run_dir, f"rank{rank}", strategy.extended.device_type))
    attempt = env.restart_count if env else (task.attempt if task else 0)  # workers restarted by the launcher
    resumed_at = loop.resume(checkpoint.find(spec, run_dir, restarted=attempt > 0))
    if rank == 0:
        outputs.record_start(run_dir, attempt, resumed_at)
    loop_started = time.perf_counter()
    with heartbeat.start(env, run_dir, spec.launch.collective_timeout_s) as watch, _finishing(strategy):
        losses = loop.run(resumed_at, env is not None and env.world_size > 1, watch)
        loop_seconds = time.perf_counter() - loop_started
        metrics = loop.end_metrics if loop.end_metrics is not None else loop.evaluation(watch, "evaluation at the end")
    warn_if_all_skipped(loop.skipped_steps, spec.trainer.steps, rank)
    if metrics and rank == 0:
        log.info("eval: %s", said(metrics))
        outputs.append_evaluation(run_dir / outputs.METRICS, spec.trainer.steps, metrics)
    summary = _summary(spec, plan, env, strategy, loop, losses, model, metrics, resumed_at, (started, loop_seconds))
    summary["history"] = outputs.history(run_dir)  # over every command since the run began afresh
    strategy.extended.finish()  # a parameter-server chief: the ps tasks stop the workers, then end
    if rank == 0:
        outputs.write_json_atomic(run_dir / outputs.SUMMARY, summary)
    return summary


def _check_built(parts: recipe_lib.Parts, ctx: recipe_lib.BuildContext, spec: RunSpec, strategy: Strategy) -> None:
    """Before the first step: input files the recipe ignores (a warning), and a class named in
    ``trainer.activation_checkpointing`` that its one model lacks (an error, which a script's models are spared)."""
    recipe_lib.warn_if_files_unused(parts, ctx, spec.recipe.name)
    activation_checkpointing.apply(parts.model, strategy.activation_checkpointing)


def _summary(spec: RunSpec, plan: Plan, env: WorkerEnv | None, strategy: Any, loop: "_Loop", losses: list[float],
             model: Any, metrics: dict[str, float], resumed_at: int, timing: tuple[float, float]) -> dict[str, Any]:
    """What ``summary.json`` says of a finished run; ``timing``: (when train started, seconds in the loop)."""
    started, loop_seconds = timing
    curve = loop.curve or losses
    return {
        "status": "completed",
        "strategy": spec.strategy.name,
        "recipe": spec.recipe.name,
        "cluster": spec.cluster.shape,
        "device": plan.device_type,
        "backend": plan.backend if strategy.num_replicas_in_sync > 1 or plan.processes > 1 else None,
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "world_size": plan.world_size,
        "global_batch_size": spec.input.global_batch_size,
        "per_replica_batch_size": spec.per_replica_batch_size,
        "rows_per_step": loop.stream.rows_per_batch,  # as trained: a recipe's iterable makes its own batches
        "steps": spec.trainer.steps,
        "resumed_from_step": resumed_at or None,
        "restarts": env.restart_count if env else 0,
        "first_loss": curve[0] if curve else None,
        "final_loss": curve[-1] if curve else None,
        "examples_per_sec": _examples_per_sec(spec, resumed_at, loop_seconds, loop),
        "wall_seconds": time.perf_counter() - started,
        "steady_ms_per_step": loop.steady_ms_per_step(),
        "first_step_seconds": loop.step_seconds[0] if loop.step_seconds else None,
        "param_norm": param_norm(model, unwrap(model)),
        "metrics": metrics,
        "precision": spec.trainer.precision,
        "skipped_steps": loop.skipped_steps,
        "best": loop.ckpt.best.summary(loop.ckpt.root),
    }


def _examples_per_sec(spec: RunSpec, resumed_at: int, loop_seconds: float, loop: "_Loop") -> float | None:
    """This command's training throughput after its first step (compile, warm-up), evaluations and saves left out; a
    resume with nothing left: the last logged."""
    ran, first = spec.trainer.steps - resumed_at, loop.step_seconds[:1]
    loop_seconds -= loop.aside_seconds
    if ran > 1 and first:  # the first step's own save is in the aside already: a save every step counted it twice
        ran, loop_seconds = ran - 1, loop_seconds - (first[0] - loop.first_aside)
    if ran > 0:
        return ran * (loop.stream.rows_per_batch or 0) / max(loop_seconds, 1e-9)
    rates = [r["examples_per_sec"] for r in outputs.read_records(loop.run_dir / outputs.METRICS) if "examples_per_sec" in r]
    return rates[-1] if rates else None


@contextlib.contextmanager
def _finishing(strategy: Any) -> Iterator[None]:
    """A parameter-server chief stopped by a signal (after its save) still ends the job: the ps tasks need not wait."""
    try:
        yield
    except Preempted:
        strategy.extended.finish()
        raise


@dataclasses.dataclass
class _Loop:
    """The steps from a (possibly resumed) start to ``trainer.steps``: log, evaluate, checkpoint, stop on signals."""

    spec: RunSpec
    strategy: Strategy
    model: Any
    optimizer: Any
    stream: DataStream
    ckpt: Checkpointer
    run_dir: Path
    chief: bool
    console: Console | None
    step: ReplicaStep
    schedule: Any  # torch LR scheduler, or None for a constant lr
    evaluate: Evaluator
    profiler: StepProfiler
    curve: list[float] = dataclasses.field(default_factory=list)  # the whole run's logged losses, once run() ends
    loggers: list = dataclasses.field(default_factory=list)  # trainer.loggers (the chief's)
    step_seconds: list[float] = dataclasses.field(default_factory=list)  # wall time of each step this process ran
    aside_seconds: float = 0.0  # of that, in evaluations and checkpoint saves: not training, so no examples/s
    first_aside: float = 0.0  # of the aside, what the first step's own evaluation and save took
    skipped_steps: int = 0  # fp16-mixed: updates skipped for inf/NaN gradients, as of the last log
    end_metrics: dict[str, float] | None = None  # the end's evaluation where the loop ran it (to judge the best by)

    def steady_ms_per_step(self) -> float | None:
        """Median ms per step from this run's 20th step on (warm-up left out); None for runs of fewer than 21 steps."""
        return statistics.median(self.step_seconds[19:]) * 1000 if len(self.step_seconds) >= 21 else None

    def resume(self, path: Path | None) -> int:
        """Load ``path`` (None: start at step 0); return the step it was saved after."""
        if path is None:
            checkpoint.agree(None, 0)
            init = self.spec.trainer.pretrained
            if init.path is not None:  # the path the parent verified (cli/job.py)
                weights.agree(Path(init.path))  # before any rank loads: a load under DTensor is collective
                found = weights.load(Path(init.path), self.model, init.strict)  # the parent said what it loads
                log.debug("pretrained: %s from %s", found.said(), init.path)
            self._open(0)
            return 0
        step, position = self.ckpt.load(path, self.model, self.optimizer, loop_state(self.schedule, self.step))
        restore_loop_state(self.ckpt.loaded_loop, self.schedule, self.step, step)
        checkpoint.agree(path, step)
        with torch.random.fork_rng(devices=[]):  # a loader's iter() draws its seed: the steps' RNG goes on as saved
            self.stream.seek(position)
        log.info("resumed from %s: step %d, epoch %d, batch %d of that epoch", path, step, position.epoch, position.offset)
        self._open(step)
        return step

    def _open(self, step: int) -> None:
        """Variables held elsewhere (parameter servers) are ready once loaded: the other tasks may start."""
        self.strategy.extended.open(step)

    def run(self, start: int, distributed: bool, watch: heartbeat.Heartbeat) -> list[float]:
        watch.last_completed = self.finite = start  # finite: the last step known finite (loss read, or saved)
        if self.ckpt.enabled:
            with watch.operation("checkpoint clean-up barrier"):
                self.ckpt.start(start)
        steps = self.spec.trainer.steps
        progress = ProgressReporter(steps, enabled=self.chief, console=self.console or Console(emoji=False, stderr=True), start=start)
        metrics_log = outputs.MetricsLog(self.run_dir / outputs.METRICS, resumed_at=start) if self.chief else None
        self.loggers = make_loggers(self.spec.trainer.loggers, self.run_dir) if self.chief else []
        meter = Meter(self.stream, steps, start, self.step_seconds, aside=lambda: self.aside_seconds)
        losses: list[float] = []
        try:
            stops = StopRequests(distributed, force_on_repeat=not distributed, elsewhere=self.strategy.extended.stop_requested,
                                 saves=self.ckpt.enabled, torn_down=functools.partial(outputs.torn_down, self.run_dir, self.ckpt.rank))
            with self.profiler as prof, stops as stop:  # stops settles its all-reduce before a cut-short window stops
                for step in range(start + 1, steps + 1):
                    tick = time.perf_counter()
                    logged = is_logged(step, self.spec.trainer)
                    with watch.step(step), stop.at_once_inside(step == start + 1 and step < steps):
                        with prof.region("dlaunch.data"):
                            batch = next(self.stream)
                        with prof.region("dlaunch.step"):
                            self.step.begin()
                            per_replica = self.strategy.run(self.step, args=(batch, logged, self.stream.rows, self.stream.pad))
                    lr = current_lr(self.optimizer) if logged else {}  # the lr this step used, before the schedule moves
                    if self.schedule is not None:
                        self.schedule.step()
                    if logged:
                        with watch.operation(f"loss reduce at step {step}"), prof.region("dlaunch.log"):
                            losses.append(self._log(step, per_replica, lr, meter, progress, metrics_log))
                    else:
                        progress.advance(step)
                    self._after(step, watch, stop, metrics_log, None if logged else per_replica)
                    if step < steps:
                        with watch.operation(f"reading ahead after step {step}"), prof.region("dlaunch.data"):
                            self.stream.read_ahead()
                    if prof.ending:
                        stop.settle()  # no collective may record into the profiler while torch stops it
                    prof.step()
                    self.step_seconds.append(time.perf_counter() - tick)
                    if len(self.step_seconds) == 1:
                        self.first_aside = self.aside_seconds
        except StoppedEarly as early:  # in this command's first step (compiling, maybe): nothing new to save
            raise Preempted(early.signum, start, in_step=True) from None
        finally:
            progress.close()
            for logger in self.loggers:
                logger.close()
            if metrics_log:
                self.curve = [r["loss"] for r in metrics_log.kept if "loss" in r] + losses
                metrics_log.close()
        return losses

    def _after(self, step: int, watch: heartbeat.Heartbeat, stop: StopRequests, metrics_log: Any, unread: Any) -> None:
        """After step ``step``: evaluate, checkpoint, and stop (after a save) on an agreed signal.
        ``unread``: the step's loss where ``_log`` did not read it (checked before a save)."""
        steps, eval_every, prof, best = self.spec.trainer.steps, self.spec.trainer.eval_every, self.profiler, self.ckpt.best
        began = time.perf_counter()
        # the end's evaluation comes after the last save, unless the best checkpoint is judged by it
        evaluates = bool(eval_every and step % eval_every == 0 and step < steps) or (step == steps and best.enabled)
        saves = self.ckpt.due(step)
        if evaluates:
            label = f"evaluation at step {step}" if step < steps else "evaluation at the end"
            with stop.during(f"the {label}"):
                found = self.evaluation(watch, label)
            if found and self.chief and step < steps:
                log.info("eval at step %d: %s", step, said(found))
            self._write({"step": step, **found}, metrics_log)
            self.end_metrics = found if step == steps else None
            saves = best.judge(step, found) or saves  # collective: every rank judges
        if saves:
            with watch.operation(f"checkpoint save at step {step}"), prof.region("dlaunch.checkpoint"), \
                    stop.during(f"the checkpoint save at step {step}"):
                self._save(step, watch, unread)
        self.aside_seconds += time.perf_counter() - began
        with watch.operation(f"stop-signal agreement after step {step}"):
            signum = stop.agreed(now=evaluates or saves)  # a signal during them: no step more
        if signum and step < steps:  # a signal during the last step: the run is complete
            with watch.operation(f"checkpoint save on a stop signal after step {step}"):
                saved = self._save(step, watch, unread, stopping=True) if self.ckpt.enabled else None
            raise Preempted(signum, step, saved, unsaved=self.ckpt.unsaved)

    def evaluation(self, watch: heartbeat.Heartbeat, label: str) -> dict[str, float]:
        """The recipe's evaluation; where rank 0 alone runs it, the other ranks wait for it without a timeout."""
        with watch.operation(label), self.profiler.region("dlaunch.eval"):
            self.step.begin()  # CUDA graphs: the evaluation's calls are one iteration, the training step's are done
            found = self.evaluate()
        if self.evaluate.chief_alone:
            watch.chief_alone(label, self.chief)
        return found

    def _log(self, step: int, per_replica: Any, lr: dict[str, float], meter: Meter, progress: ProgressReporter,
             metrics_log: Any) -> float:
        reduced = self.strategy.reduce(ReduceOp.MEAN, per_replica, axis=None)
        loss, norm, skipped, *extras = self.strategy.extended.logged_metrics(step, reduced).tolist()
        rate, eta = meter.window(step)
        own = dict(zip(self.step.metric_names or (), extras))  # the recipe's own, averaged over the replicas
        record = {"step": step, "loss": loss, "examples_per_sec": rate, "time": time.time(), "lr": None, **lr,
                  **({} if norm == NOT_MEASURED else {"grad_norm": norm}), **own}  # inf/NaN: null in metrics.jsonl
        diverged = not math.isfinite(loss) or (norm != NOT_MEASURED and not math.isfinite(norm))
        if diverged and not self.step.scaler:  # fp16-mixed skips such steps and lowers its scale
            self._write(record, metrics_log)  # the diverged step's record too: its lr and grad_norm tell why
            known = self.finite  # its last completed step: the last one known to be finite
            said = loss_not_finite(loss, step, known) if not math.isfinite(loss) else grad_norm_not_finite(norm, loss, step)
            raise heartbeat.tag(said, known, f"train step {step}")
        self.finite = step if math.isfinite(loss) else self.finite
        progress.logged(step, loss, rate, eta, own)
        if self.step.scaler is not None:
            self.skipped_steps = int(skipped)
            record["skipped_steps"] = self.skipped_steps
        self._write(record, metrics_log)
        return loss

    def _write(self, record: dict[str, Any], metrics_log: Any) -> None:
        if len(record) == 1:  # an evaluation with nothing to report here (another rank's, or no evaluate)
            return
        if metrics_log:
            metrics_log.write(record)
        for logger in self.loggers:
            logger.log(record)

    def _save(self, step: int, watch: heartbeat.Heartbeat, unread: Any = None, stopping: bool = False) -> Path | None:
        """A checkpoint never holds what a non-finite loss made: a loss no log line read is read first. Rank 0 alone
        verifies and commits it (it reads every rank's files back): the others wait for that outside any collective."""
        known = self.finite
        if unread is not None and self.step.scaler is None:
            loss = float(self.strategy.reduce(ReduceOp.MEAN, unread, axis=None))
            if not math.isfinite(loss):
                raise heartbeat.tag(LossNotFinite(f"loss is {loss} at step {step}, before its checkpoint (not saved); "
                                                  "lower recipe.optimizer.lr or check the data"),
                                    known, f"checkpoint save at step {step}")
        if parameters_diverged(self.strategy, self.model):  # gradients that overflowed under a finite loss
            raise heartbeat.tag(parameters_not_finite(step), known, f"checkpoint save at step {step}")
        self.finite = step
        saved = self.ckpt.save(step, self.stream.position, self.model, self.optimizer, loop_state(self.schedule, self.step),
                               stopping)
        watch.chief_alone(f"checkpoint commit at step {step}", self.chief)
        return saved
