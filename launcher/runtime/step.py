"""One replica's training step: precision, gradient accumulation, clipping (the schedule: ``schedule.py``).

The loop calls ``strategy.run(step, args=(batch, measure))`` once per global batch.
Each replica gets its share of the batch and, with ``trainer.grad_accum_steps=k``,
cuts it into ``k`` micro-batches: forward and backward per micro-batch (gradient
sync only on the last one, where the model is DDP or FSDP2), then one update. Since the
share is cut, not the data stream, a step consumes the same global batch with
or without accumulation, and checkpoints and resume are unchanged.

A step returns ``[loss, grad_norm, skipped_steps]`` as one tensor, so the loop
reduces its metrics in one collective at log steps only and nothing waits for
the device in between. ``grad_norm`` is the total norm of the averaged
gradients before clipping (inf or NaN where they were; ``NOT_MEASURED`` where no
norm was taken: a manual step, a parameter-server model); ``skipped_steps``
counts the updates fp16's GradScaler skipped for inf/NaN gradients so far.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable

import torch

from launcher.checkpoint.state import primary
from launcher.config.trainer import TrainerSpec
from launcher.distribute.grad_norm import averaged_grad_norm
from launcher.distribute.gradient_sync import no_sync
from launcher.distribute.precision import autocast
from launcher.distribute.values import map_structure
from launcher.input.split import batch_size_of, slice_batch
from launcher.runtime.compiled import compile_error
from launcher.runtime.outputs import RESERVED_METRICS, is_reserved
from launcher.runtime.progress import log
from launcher.runtime.recipe import described, where

_NOT_SETTINGS = ("params", "fused", "foreach", "capturable", "differentiable")  # a param group's keys a resume keeps
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile's modes that capture CUDA graphs
NOT_MEASURED = -1.0  # the grad_norm of a step that took none (a norm is never negative, and a mean of -1s stays -1)


class StepError(TypeError):
    """The recipe's ``train_step`` returned something the loop cannot train on."""

    explained = True  # the message names the function and what it must return: dlaunch's frames add nothing


def is_logged(step: int, trainer: TrainerSpec) -> bool:
    """Whether the loop logs step ``step`` (reads its metrics): the first, every ``trainer.log_every``-th and the last."""
    return step == 1 or step % trainer.log_every == 0 or step == trainer.steps


class ReplicaStep:
    """``step(batch, measure) -> tensor([loss, grad_norm, skipped])`` for one replica (thread-safe across replicas);
    the loss alone when not ``measure`` (a step the loop does not log)."""

    def __init__(self, user_step: Callable[..., Any], model: Any, optimizer: Any, trainer: TrainerSpec,
                 device_type: str, manual: bool, name: str = "train_step"):
        self.user_step, self.model, self.optimizer = user_step, model, optimizer
        self.stand_ins: dict[int, Any] = {}  # each replica's last batch, stepped on at weight 0 when it gets no rows
        self.manual, self.name = manual, name
        self.accum, self.max_norm = trainer.grad_accum_steps, trainer.clip_grad_norm
        self.precision = trainer.precision
        self.device_type = device_type
        # One scaler per process: fp16-mixed is refused where replicas are threads of one process.
        self.scaler = torch.amp.GradScaler(device_type) if trainer.precision == "fp16-mixed" else None
        self.skipped: torch.Tensor | None = None  # skipped updates so far, on the device (fp16-mixed)
        self.compile = trainer.compile if trainer.compile.enabled else None
        self.graphs = self.compile is not None and self.compile.mode in CUDA_GRAPH_MODES
        self.metric_names: tuple[str, ...] | None = None  # a recipe's own metrics (its step returns a dict), once seen
        # The hyperparameters the recipe set (lr, momentum, weight decay, a schedule's initial_lr), before a
        # checkpoint's are loaded over them: this command's settings stand, the checkpoint restores the state.
        # The kernel flags stay the checkpoint's: torch placed the loaded state (Adam's step) for them.
        self.recipe_groups = [{k: float(v) if isinstance(v, torch.Tensor) else v for k, v in g.items() if k not in _NOT_SETTINGS}
                              for g in getattr(primary(optimizer), "param_groups", [])]

    def begin(self) -> None:
        """A training step (or an evaluation) starts. Under CUDA graphs (``trainer.compile.mode`` reduce-overhead
        or max-autotune) the outputs of the graphs run since the last call may be overwritten from now on, and
        not before: a step that calls the model twice, once under ``no_grad`` (a target, a teacher), keeps both
        outputs. Torch's own guess, a new iteration at every call with no backward pending, would overwrite the
        first output with the second. Once marked, torch takes only these marks."""
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def autocast(self, cache: bool = True) -> contextlib.AbstractContextManager:
        """Autocast is per thread: each replica enters its own. ``cache=False`` for a region whose weights may change
        in place (an evaluation that swaps in an EMA's values)."""
        return autocast(self.precision, self.device_type, cache)

    def __call__(self, batch: Any, measure: bool = False, rows: int | None = None, pad: Any = None) -> torch.Tensor:
        """``rows``: the global batch's rows, which ``batch`` is this replica's share of (None: an even share).
        ``pad``: rows to step on at weight 0 where ``batch`` has none (the input's; None: this replica's last batch)."""
        if self.compile is None:
            return self._step(batch, measure, rows, pad)
        try:
            return self._step(batch, measure, rows, pad)
        except Exception as exc:
            raise compile_error(exc, self.model, self.compile.fullgraph) or exc

    def _step(self, batch: Any, measure: bool, rows: int | None = None, pad: Any = None) -> torch.Tensor:
        if self.manual:
            with self.autocast():
                loss, extra = self._checked(self.user_step(self.model, batch, self.optimizer), measure)
            return _metrics(loss.detach(), None, self.skipped, extra) if measure else loss.detach()
        # who else steps in sync, only where it matters: an uneven share, or micro-batches (not on the common step)
        replica, replicas = _replica_and_averaged_over() if rows is not None or self.accum > 1 else (0, 1)
        batch, weight = self._share(batch, rows, pad, replica, replicas)
        # Replicas in sync run the same number of micro-batches, whatever their share of a last partial batch: each
        # micro-batch's forward and backward may be collectives (FSDP2 gathers at every forward, replica threads
        # average at every backward). A share of fewer rows than that repeats its last piece at weight 0.
        micro, shares = micro_batches(batch, self.accum, exactly=replicas > 1) if self.accum > 1 else ((batch,), None)
        total = extras = None
        for i, piece in enumerate(micro):
            if i:  # each micro-batch's graphs replay the first one's; its loss is kept (a clone, under CUDA graphs)
                self.begin()
            with self._sync_on(i == len(micro) - 1):
                with self.autocast():
                    loss, extra = self._checked(self.user_step(self.model, piece), measure)
                if not loss.requires_grad:
                    raise self._no_graph()
                scaled = loss if len(micro) == 1 else loss / len(micro) if shares is None else loss * shares[i]
                scaled = scaled if weight == 1 else scaled * weight
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            share = 1.0 / len(micro) if shares is None else shares[i]  # the micro-batch's part of the batch's mean
            kept = loss.detach().clone() if self.graphs else loss.detach()  # a graph's output is overwritten later
            part = kept if shares is None else kept * shares[i]
            total = part if total is None else total + part
            if extra is not None:
                extras = extra * share if extras is None else extras + extra * share
        total = total / len(micro) if shares is None and len(micro) > 1 else total
        if weight != 1:
            total, extras = total * weight, None if extras is None else extras * weight
        return self._update(total, measure, extras)

    def _share(self, batch: Any, rows: int | None, pad: Any, replica: int, replicas: int) -> tuple[Any, float]:
        """The batch to step on and the weight of its mean loss. A global batch of ``rows`` that does not split
        evenly (51 rows over 2 replicas: 26 and 25; a last partial batch) gives replica shares of ``n`` rows: each
        mean is weighted by ``n * replicas / rows``, so that the strategy's average of the replicas' gradients is
        the gradient of the global batch's mean, as on one device (TF divides by the global batch). A replica with
        no rows steps on its last batch (or, first after a start or a resume, on the input's ``pad``) at weight 0:
        it joins the gradient sync with zeros, and no model code sees a batch of 0 rows."""
        if rows is None or replicas == 1:
            return batch, 1.0
        try:
            n = batch_size_of(batch)
        except ValueError:  # no tensors to count rows of: as before, an even share
            return batch, 1.0
        if n == 0:
            stand_in = self.stand_ins.get(replica)
            if stand_in is None and pad is not None:
                stand_in = _on_device_of(pad, batch)
            if stand_in is None:
                raise StepError(f"replica {replica}'s first batch has no rows: the global batch of {rows} row(s) "
                                f"is smaller than the {replicas} replicas in sync")
            return stand_in, 0.0
        self.stand_ins[replica] = batch
        return batch, 1.0 if n * replicas == rows else n * replicas / rows

    def _update(self, loss: torch.Tensor, measure: bool, extras: torch.Tensor | None = None) -> torch.Tensor:
        norm = None
        if self.scaler is not None and (measure or self.max_norm is not None):
            self.scaler.unscale_(self.optimizer)  # norms and clipping see true gradients
        if measure or self.max_norm is not None:
            norm = averaged_grad_norm(self.model, self.optimizer, self.max_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            found = _found_inf(self.scaler, self.optimizer).to(loss.device)
            self.skipped = found if self.skipped is None else self.skipped.to(found.device) + found
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Only logged steps' results are read: the others skip building the metrics (a few kernels per step).
        return _metrics(loss, norm, self.skipped, extras) if measure else loss

    def _sync_on(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP all-reduces and FSDP2 reduce-scatters once per step: on the last micro-batch."""
        return contextlib.nullcontext() if last else no_sync(self.model)

    def _checked(self, result: Any, measure: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss, and at a logged step the recipe's own metrics (a dict's other values) as one tensor."""
        loss, metrics = (result.get("loss"), result) if isinstance(result, dict) else (result, None)
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            loss = loss.float() if loss.dtype != torch.float32 else loss
            return loss, self._metric_values(metrics, loss.device) if metrics is not None and measure else None
        raise StepError(
            f"the recipe's {self.name}() ({where(self.user_step)}) returned {_wrong_loss(result, metrics, loss)}; it must "
            "return the loss as a scalar tensor, e.g. "
            "`return torch.nn.functional.mse_loss(model(x), y)` (reduce a per-example loss with .mean()), or a dict of "
            "it and metrics of its own to log, `{\"loss\": loss, \"accuracy\": acc}`"
        )

    def _metric_values(self, metrics: dict[str, Any], device: torch.device) -> torch.Tensor:
        """The metrics besides ``loss``, in the order of their names on the first logged step (the same every step)."""
        names = tuple(sorted((k for k in metrics if k != "loss"), key=str))  # a key that is no string is named below
        if self.metric_names is None:
            taken = [n for n in names if not isinstance(n, str) or is_reserved(n)]
            if taken:
                raise StepError(f"the recipe's {self.name}() ({where(self.user_step)}) returned metrics named {taken}; "
                                f"dlaunch's records use {sorted(RESERVED_METRICS)} and lr_group1, lr_group2, ...: "
                                f"name them otherwise")
            self.metric_names = names
        elif names != self.metric_names:
            raise StepError(f"the recipe's {self.name}() ({where(self.user_step)}) returned the metrics {list(names)}, "
                            f"and {list(self.metric_names)} at the first logged step: every step returns the same ones")
        values = [metrics[n] for n in names]
        bad = [n for n, v in zip(names, values) if not _scalar(v)]
        if bad:
            raise StepError(f"the recipe's {self.name}() ({where(self.user_step)}) returned metrics {bad} that are not "
                            "numbers: each must be a number or a one-element tensor (e.g. `acc.mean()`, not a tensor per example)")
        return torch.stack([v.detach().float().reshape(()).to(device) if isinstance(v, torch.Tensor)
                            else torch.tensor(float(v), device=device) for v in values]) if values else torch.zeros(0, device=device)


    def _no_graph(self) -> StepError:
        return StepError(
            f"the recipe's {self.name}() ({where(self.user_step)}) returned a loss that does not require grad, so dlaunch "
            "cannot backpropagate it: was it detached (.detach(), .item(), a new tensor from its value), or computed "
            "under torch.no_grad(), or has the model no parameter that trains? Return the loss the model's output made (a step that does its own backward takes "
            "the optimizer as a third argument: manual mode)")


def _wrong_loss(result: Any, metrics: dict | None, loss: Any) -> str:
    """What a step returned in place of a scalar loss tensor: ``a dict whose "loss" is a float (.item() ...)``."""
    if not metrics:
        got = described(result, forgot="return loss") + (" with nothing in it" if metrics is not None else "")
    elif "loss" in metrics:
        got = f"a dict whose \"loss\" is {described(loss, returned=False)}"
    else:
        got = f"a dict of {', '.join(repr(k) for k in metrics)}, without \"loss\""
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        got += " (.item() or float() makes a number, which dlaunch cannot backpropagate: return the tensor)"
    return got


def _replica_and_averaged_over() -> tuple[int, int]:
    """This replica's id, and how many replicas' gradients the strategy averages (1 outside a replica context)."""
    from launcher.distribute.context import get_replica_context, get_strategy

    context = get_replica_context()
    if context is None:
        return 0, 1
    return context.replica_id_in_sync_group, get_strategy().extended._gradients_averaged_over


def split_batch(batch: Any, k: int) -> list[Any]:
    """``batch`` (tensors, or tuples/lists/dicts of them) cut into ``k`` micro-batches along dim 0: equal ones, or,
    for a batch that does not divide (the last of an epoch with ``input.drop_remainder=false``), sizes that differ by
    one row; a batch of fewer than ``k`` rows gives one micro-batch a row."""
    return micro_batches(batch, k)[0]


def micro_batches(batch: Any, k: int, exactly: bool = False) -> tuple[list[Any], list[float] | None]:
    """``split_batch``'s micro-batches, and each one's share of the rows where they differ (None: equal, each
    counts 1/k): the batch's mean loss is the shares' weighted sum of the micro-batches' mean losses. ``exactly``:
    ``k`` of them even from a batch of fewer rows, whose last one repeats at share 0."""
    sizes = _sizes(batch, k)
    shares = None if len(set(sizes)) == 1 else [size / sum(sizes) for size in sizes]
    pieces = _split(batch, sizes)
    if exactly and len(pieces) < k:
        shares = (shares or [1.0 / len(pieces)] * len(pieces)) + [0.0] * (k - len(pieces))
        pieces += [pieces[-1]] * (k - len(pieces))
    return pieces, shares


def _sizes(batch: Any, k: int) -> list[int]:
    try:
        n = batch_size_of(batch)
    except ValueError as exc:
        raise TypeError(f"trainer.grad_accum_steps cuts a batch's tensors along their first dimension: {exc}") from None
    k = max(1, min(k, n))
    return [n // k + (i < n % k) for i in range(k)]


def _split(batch: Any, sizes: list[int]) -> list[Any]:
    """Consecutive rows of every tensor; other values (a column of ids) go to every micro-batch as they are,
    and the batch keeps its type (a namedtuple stays one), as in the split across replicas."""
    ends = list(itertools.accumulate(sizes))
    return [slice_batch(batch, end - size, end) for size, end in zip(sizes, ends)]



def _on_device_of(pad: Any, batch: Any) -> Any:
    """``pad``'s tensors on the device of ``batch``'s (the input moved the batch, not its pad)."""
    devices = set()
    map_structure(lambda t: devices.add(t.device) if isinstance(t, torch.Tensor) else None, batch)
    device = devices.pop() if len(devices) == 1 else None
    return pad if device is None else map_structure(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, pad)


def _found_inf(scaler: torch.amp.GradScaler, optimizer: Any) -> torch.Tensor:
    """1.0 where ``scaler.step`` skipped the update, without waiting for the device."""
    states = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    found = list(states.get("found_inf_per_device", {}).values())
    return (sum(f.float() for f in found) > 0).float() if found else torch.zeros(())


def _metrics(loss: torch.Tensor, norm: torch.Tensor | None, skipped: torch.Tensor | None,
             extras: torch.Tensor | None = None) -> torch.Tensor:
    """``[loss, grad_norm, skipped, *the recipe's metrics]``: one tensor, one reduction."""
    unmeasured = torch.full((), NOT_MEASURED, device=loss.device)
    parts = [loss.float(), unmeasured if norm is None else norm.float().to(loss.device),
             torch.zeros((), device=loss.device) if skipped is None else skipped.float().to(loss.device)]
    return torch.stack(parts) if extras is None else torch.cat([torch.stack(parts), extras.to(loss.device)])


def _scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------- what a checkpoint holds of the loop ----------
def loop_state(schedule: Any, step: ReplicaStep) -> dict[str, torch.Tensor]:
    """The schedule's position and the scaler's scale, as tensors (the optimizer's lr is in its own state)."""
    state: dict[str, torch.Tensor] = {}
    if schedule is not None:
        state["schedule_last_epoch"] = torch.tensor(schedule.last_epoch, dtype=torch.int64)
    if step.scaler is not None and step.scaler.is_enabled():
        saved = step.scaler.state_dict()
        state["scaler_scale"] = torch.tensor(saved["scale"], dtype=torch.float64)
        state["scaler_growth_tracker"] = torch.tensor(saved["_growth_tracker"], dtype=torch.int64)
        state["skipped_steps"] = torch.zeros((), dtype=torch.float32) if step.skipped is None else step.skipped.detach().cpu()
    return state


def restore_loop_state(state: dict[str, torch.Tensor], schedule: Any, step: ReplicaStep, resumed_at: int) -> None:
    """After a load: the recipe's hyperparameters over the saved ones (a changed lr is the plan's ``changed`` row,
    and applies; a run saved under a schedule and resumed without one trains at the lr, not the decayed one), then
    this run's schedule at the saved position (at the resumed step where the checkpoint had no schedule)."""
    for group, recipe in zip(getattr(primary(step.optimizer), "param_groups", []), step.recipe_groups):
        for key, value in recipe.items():
            _set(group, key, value)
    if schedule is not None:
        schedule.last_epoch = int(state.get("schedule_last_epoch", resumed_at))
        # The lr of the schedule this run has at that position, as LambdaLR.step() sets it: the saved one where the
        # schedule is the same, the longer schedule's where trainer.steps grew (not the old one's for a step).
        for group, base, factor in zip(schedule.optimizer.param_groups, schedule.base_lrs, schedule.lr_lambdas):
            _set(group, "lr", base * factor(schedule.last_epoch))
        schedule._last_lr = [float(g["lr"]) for g in schedule.optimizer.param_groups]  # what get_last_lr() reports
    if step.scaler is not None and "scaler_scale" in state:
        step.scaler.load_state_dict({
            **step.scaler.state_dict(),
            "scale": float(state["scaler_scale"]), "_growth_tracker": int(state["scaler_growth_tracker"]),
        })
        step.skipped = state["skipped_steps"].clone()


def _set(group: dict[str, Any], key: str, value: Any) -> None:
    """A tensor setting (a capturable or fused optimizer's lr) keeps its tensor, as torch's schedulers do."""
    if isinstance(group.get(key), torch.Tensor):
        group[key].fill_(value)
    else:
        group[key] = value


def warn_if_all_skipped(skipped: int, steps: int, rank: int = 0) -> None:
    """fp16-mixed: GradScaler skips a step whose gradients are not finite, and a few early ones are usual. When it
    skipped every step of the run, the model never changed (a NaN loss skips them all): said once, by rank 0 (every
    rank counts the same skips), at the end."""
    if rank == 0 and steps > 0 and skipped >= steps:
        log.warning("fp16-mixed skipped all %d steps of the run (inf/NaN gradients): the model did not train; "
                    "check that the loss is finite under trainer.precision=fp32, or try bf16-mixed", steps)
