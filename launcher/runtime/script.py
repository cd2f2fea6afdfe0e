"""Script mode, on the worker side: run the user's script as ``__main__`` under the configured strategy.

Each worker process (or dlaunch itself, for one process) builds the strategy the
plan names, makes it current with ``experimental_set_strategy`` (so that the
script's ``dl.get_strategy()`` returns it), and runs the script with
``runpy.run_path(path, run_name="__main__")`` and ``sys.argv = [path, *args]``,
as ``python path args`` would. Plain ``print`` goes to the terminal (rank 0) and
to ``RUN_DIR/logs`` (the other ranks), as a recipe's output does.
"""

from __future__ import annotations

import argparse
import contextlib
import runpy
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console

from launcher import strategies
from launcher.cluster import env as env_lib
from launcher.cluster.env import WorkerEnv
from launcher.config.plan import Plan
from launcher.config.schema import RunSpec
from launcher.distribute.context import experimental_set_strategy
from launcher.runtime import outputs, script_process as process, user_frames
from launcher.runtime.preemption import Preempted
from launcher.runtime.progress import log
from launcher.runtime.stop_signals import STOP_SIGNALS, handling_stop_signals


class ScriptStopped(Preempted):
    """A stop signal reached the script; a script saves its own checkpoints (dlaunch cannot know its state)."""

    def __init__(self, signum: int, where: str = ""):
        """``where``: the script's frame the signal found it in (``main (train.py:63)``), for a rank that hung."""
        super().__init__(signum, step=None)
        at = f" in {where}" if where else ""
        self.args = (f"stopped by {signal.Signals(signum).name}{at}; a script saves its own checkpoints "
                     "(ScriptCheckpoints)",)


class ScriptInterrupted(ScriptStopped, KeyboardInterrupt):
    """SIGINT (Ctrl-C): a ``KeyboardInterrupt`` too, as under ``python`` and ``torchrun``, so a script's own
    ``except KeyboardInterrupt:`` (a clean-up, a rank-0 note) runs under dlaunch as it does there. A collective save
    from there can wait on a rank stopped elsewhere (docs/SCRIPTS.md): save every N steps instead."""


class ScriptExit(Exception):
    """The script called ``sys.exit`` with a failure code (argparse does for a bad argument, after its message)."""

    explained = True

    def __init__(self, script: str, code: Any):
        self.code = code
        # sys.exit("why") shows its message here; a script that exits with a code may have printed nothing
        super().__init__(f"{script} exited with {code!r} (sys.exit)"
                         + ("; anything it printed before is above" if isinstance(code, int) else ""))

    @property
    def script_exit_code(self) -> int:
        """What ``python script.py`` exits with, from 1 to 127; 1 for a message (``sys.exit("why")``) and for a
        code from 128 on, which in dlaunch's exit codes means stopped by signal N - 128."""
        return self.code if isinstance(self.code, int) and 0 < self.code < 128 else 1


def run(spec: RunSpec, env: WorkerEnv | None, run_dir: Path, plan: Plan, console: Console | None = None) -> dict[str, Any]:
    """Run ``spec.script`` in this process under the spec's strategy; rank 0 writes the summary."""
    from launcher.runtime.loop import seed_everything

    started = time.perf_counter()
    rank = env.rank if env else 0
    runtime = strategies.Runtime(env, plan.device_type, plan.backend,
                                 spec.launch.collective_timeout_s, run_spec=spec)
    seed_everything(spec.trainer.seed)
    strategy = strategies.build(spec.strategy, runtime)
    strategy.extended.warn_uneven_shares = True  # the script weights its own loss: say when a batch splits unevenly
    log.info("%s: %d replica(s) in sync on %s; running %s", type(strategy).__name__, strategy.num_replicas_in_sync,
             ", ".join(strategy.extended.worker_devices), spec.script.command())
    experimental_set_strategy(strategy)
    if rank == 0:  # the run's history counts the workers' (re)starts, as a recipe run's does
        outputs.record_start(run_dir, env.restart_count if env else 0, 0)
    first_step = _watch_the_first_step(strategy, spec.strategy.name, env) if rank == 0 else None
    try:
        with _as_main(spec.script, quiet_argparse=rank != 0), _stop_signals_raise() as own, \
                process.as_torchrun(env, spec.launch.collective_timeout_s), process.logging_as_python(), \
                process.hydra_set_aside(), process.native_crash_shown(env), \
                env_lib.worker_env_set(env_lib.script_environment(run_dir)):
            try:
                if spec.script.module:  # as python -m: its package imported first, so relative imports work
                    runpy.run_module(spec.script.module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(spec.script.path, run_name="__main__")
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    raise ScriptExit(spec.script.module or Path(spec.script.path).name, exc.code) from None
        if own and env is not None:  # a worker's own handler took the stop the agent passed on, and the script
            # ended: a stop, as under torchrun (in one process the signal was the script's alone, as under python)
            raise ScriptStopped(own[0], "the script's own handler, after which it ended")
    finally:
        experimental_set_strategy(None)
        if first_step is not None:
            first_step.remove()
    if rank == 0:
        _say_if_precision_unused(strategy)
        _say_if_not_prepared(strategy, spec.strategy.name)
        _say_if_not_recomputed(strategy)
    summary = {
        "status": "completed",
        "strategy": spec.strategy.name,
        "recipe": None,  # the script ran in its place
        "script": spec.script.command(),
        "cluster": spec.cluster.shape,
        "device": runtime.device_type,
        **_precision_used(spec.trainer.precision, strategy),
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "world_size": env.world_size if env else 1,
        "restarts": env.restart_count if env else 0,
        "wall_seconds": time.perf_counter() - started,
        "history": outputs.history(run_dir),
        **(outputs.script_results(run_dir) if rank == 0 else {}),  # from its own metrics.jsonl, if it writes one
    }
    if rank == 0:
        outputs.write_json_atomic(run_dir / outputs.SUMMARY, summary)
    return summary


def _precision_used(precision: str, strategy: Any) -> dict[str, Any]:
    """summary.json's ``precision`` (as asked) and, under bf16- or fp16-mixed, ``autocast_entered``: whether the
    script entered ``strategy.autocast()``. One that did not got no autocast from dlaunch (it trained in fp32 unless it
    entered torch.autocast itself, or a model prepared under fsdp computes in FSDP's bf16 parameters): runs compared
    by their summaries should not read such a run as a bf16 one."""
    if precision == "fp32":
        return {"precision": precision}
    return {"precision": precision, "autocast_entered": "autocast" not in strategy._unused_precision_helpers()}


def _say_if_precision_unused(strategy: Any, when: str = "") -> None:
    """``trainer.precision`` reaches a script through ``strategy.autocast()`` (and fp16's ``strategy.grad_scaler()``):
    a script that never asked for them did not train so, which the user should not have to find out from the speed.
    Said once: after the first optimizer step of the process (any optimizer), else at the end."""
    told = strategy.__dict__.setdefault("_precision_told", set())  # each helper once
    unused = [name for name in strategy._unused_precision_helpers() if name not in told]
    told.update(unused)
    if "autocast" in unused:
        log.warning("trainer.precision=%s: %sthe script has not entered strategy.autocast(), so unless it enters "
                    "torch.autocast itself, its forward pass runs without autocast; wrap the forward pass and the loss "
                    "in `with strategy.autocast():` (docs/SCRIPTS.md)", strategy.precision, when)
    if "grad_scaler" in unused:
        log.warning("trainer.precision=fp16-mixed: %sthe script has not called strategy.grad_scaler(), so its fp16 "
                    "gradients are not scaled and may underflow to 0; scale the loss with it (docs/SCRIPTS.md)", when)


def _say_if_not_recomputed(strategy: Any) -> None:
    """``trainer.activation_checkpointing`` reaches a script through ``strategy.prepare()``; a name that no model
    given to it contains recomputed nothing (a script may prepare several models, so it is not an error there)."""
    unfound = strategy._unfound_recompute()
    if unfound:
        log.warning("trainer.activation_checkpointing names %s, but no model the script gave strategy.prepare() "
                    "contains a module of that class%s, so nothing was recomputed for it; name the class of the model's "
                    "blocks (docs/TRAINING.md)", ", ".join(unfound),
                    "" if strategy._prepared else " (it never called strategy.prepare)")


def _watch_the_first_step(strategy: Any, name: str, env: WorkerEnv | None) -> Any:
    """Rank 0 at the script's first optimizer step, prepared or not (neither dlaunch's restore of an optimizer's state
    nor a step at lr 0, which only fills it): notes that the script trains (fsdp's and mesh's never-prepared warning
    is for such a script); tells of a ``trainer.precision`` the script has not used (a torchrun script's own DDP is
    not prepared: it was told at its end, hours late); under mirrored or multi_worker_mirrored across processes, says
    so where the model was neither prepared nor wrapped in DDP (or FSDP): one copy per process trains, never synced,
    with no error. Returns the hook's handle."""
    from torch.optim.optimizer import register_optimizer_step_post_hook  # torch.optim deletes its submodules' names

    from launcher.distribute.strategy import _zero

    def first(optimizer: Any, *_: Any) -> None:
        from launcher.checkpoint.state import is_filling

        if is_filling() or all(_zero(group.get("lr")) for group in optimizer.param_groups):
            return
        handle.remove()
        strategy.__dict__["_script_stepped"] = True
        _say_if_precision_unused(strategy, "after its first optimizer step, ")
        across = env is not None and env.world_size > 1 and name in ("mirrored", "multi_worker_mirrored")
        if across and not strategy._prepared and not _wrapped_anywhere():
            log.warning("strategy=%s: the script's model was neither given to strategy.prepare(model, optimizer) nor "
                        "wrapped in DistributedDataParallel, so each of the %d processes trains its own copy and they "
                        "are never synced (unless the script averages the gradients itself); `model, optimizer = "
                        "dl.get_strategy().prepare(model, optimizer)` syncs them (docs/SCRIPTS.md)", name, env.world_size)

    handle = register_optimizer_step_post_hook(first)
    return handle


def _wrapped_anywhere() -> bool:
    """A module of this process is DDP's or FSDP's (looked for once, at the first step: a pass over the live objects)."""
    import gc

    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    kinds = (DistributedDataParallel, FSDPModule, FullyShardedDataParallel)
    with warnings.catch_warnings():  # isinstance reads __class__, which some of torch's deprecated objects warn on
        warnings.simplefilter("ignore")
        return any(isinstance(o, kinds) for o in gc.get_objects())


# What a script gets from these strategies only through strategy.prepare(model, optimizer)
_LAID_OUT_BY_PREPARE = {"fsdp": "FSDP2's sharding (fully_shard)", "mesh": "the mesh's DTensor layout"}


def _say_if_not_prepared(strategy: Any, name: str) -> None:
    """A script under fsdp or mesh that wraps its model itself (its own DDP) trains, but unsharded: the plan's
    strategy would be a label only, which the user should not have to find out from the memory it takes."""
    what = _LAID_OUT_BY_PREPARE.get(name)
    if what and not strategy._prepared and strategy.__dict__.get("_script_stepped"):  # a script with no optimizer step
        # (a data check, an evaluation of a saved model) has no training to lay out: nothing to say
        log.warning("strategy=%s: the script never called strategy.prepare(model, optimizer), so its model did not get "
                    "%s: it trained as the script set it up (its own DDP, if it wraps one); in place of that wrapper, "
                    "`model, optimizer = dl.get_strategy().prepare(model, optimizer)` with `from launcher import "
                    "distribute as dl` (docs/SCRIPTS.md)", name, what)


@contextlib.contextmanager
def _as_main(script: Any, quiet_argparse: bool) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as ``python path args`` (or ``python -m module args``) sets them; restored
    afterwards.

    ``quiet_argparse``: this rank does not print argparse's usage, errors and help,
    so that a bad argument is reported once (by rank 0), not once per process.
    """
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script.path, *script.args]
    sys.path.insert(0, str(script.import_root))
    printer = argparse.ArgumentParser._print_message
    if quiet_argparse:
        argparse.ArgumentParser._print_message = lambda self, message, file=None: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser._print_message = printer  # type: ignore[method-assign]
        sys.argv = saved_argv
        sys.path[:] = saved_path


@contextlib.contextmanager
def _stop_signals_raise() -> Iterator[list[int]]:
    """SIGTERM, SIGINT and SIGHUP end the script with ``ScriptStopped`` (exit 128 + N), as they end a recipe run;
    SIGINT's is a ``KeyboardInterrupt`` too (``ScriptInterrupted``).

    A recipe stops between steps; a script's steps are its own, so it stops where it is. A script that handles a
    stop signal itself (saves, then ends) keeps its handler (``signal.getsignal`` gives it back as written); the
    signals its handlers took are yielded.
    """
    received: list[int] = []
    own: list[int] = []  # the stop signals a handler of the script's own took

    def stop(signum: int, frame: Any) -> None:
        if not received:  # once: Ctrl-C reaches a worker both from the terminal and forwarded by its agent
            received.append(signum)
            raise (ScriptInterrupted if signum == signal.SIGINT else ScriptStopped)(signum, user_frames.innermost(frame))

    install, look_up = signal.signal, signal.getsignal
    wrapped: dict[Any, Any] = {}  # each handler of the script's as installed -> as it wrote it

    def noted(signum: Any, handler: Any) -> Any:
        """The script's own handler of a stop signal, run as it wrote it, and the signal noted."""
        if signum in STOP_SIGNALS and callable(handler) and handler is not stop:
            def handle(number: int, frame: Any, handler: Any = handler) -> Any:
                own.append(number)
                return handler(number, frame)

            wrapped[handle] = handler
            handler = handle
        before = install(signum, handler)
        return wrapped.get(before, before)

    def as_written(signum: Any) -> Any:
        handler = look_up(signum)
        return wrapped.get(handler, handler)

    with handling_stop_signals(stop):
        signal.signal, signal.getsignal = noted, as_written
        try:
            yield own
        finally:
            signal.signal, signal.getsignal = install, look_up
