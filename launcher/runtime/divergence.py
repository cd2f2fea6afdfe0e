"""A run that diverges stops at once, with the step and the value, and no checkpoint keeps what it made.

Without fp16's GradScaler (which skips such steps and lowers its scale), a
non-finite loss, or a finite loss whose gradients overflowed, leaves inf/NaN
parameters behind it: every later step is lost. The loop reads the loss at its
log steps and before each save; the gradient norm at its log steps; and the
parameters before each save, so that a checkpoint (and the retention that prunes
older ones after it) never holds a diverged model for a resume to start from.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from launcher.distribute.reduce_op import ReduceOp

_REMEDY = "lower recipe.optimizer.lr or check the data"


class LossNotFinite(FloatingPointError):
    """The loss became inf or NaN (without fp16's GradScaler, which skips such steps)."""

    explained = True  # the step, the value and what to try: dlaunch's frames add nothing


class ParametersNotFinite(LossNotFinite):
    """The parameters became inf or NaN while the loss read so far was finite: gradients overflowed."""


def last_read_before(step: int, every: int) -> int:
    """The last step before ``step`` whose loss a log line read (0: none): the last one known to be finite."""
    return 0 if step <= 1 else max(1, (step - 1) // every * every)


def loss_not_finite(loss: float, step: int, every: int) -> LossNotFinite:
    """The loss read at log step ``step`` is not finite; it may have become so at any step since the last log."""
    since = ""
    if every > 1 and step > 1:
        last = last_read_before(step, every)
        since = f" (read every {every} steps: it became {loss} after step {last}; trainer.log_every=1 finds the first such step)"
    return LossNotFinite(f"loss is {loss} at step {step}{since}; {_REMEDY}")


def grad_norm_not_finite(norm: float, loss: float, step: int) -> LossNotFinite:
    """Step ``step``'s loss was finite, its gradients were not: its update made the parameters inf/NaN."""
    return LossNotFinite(f"grad_norm is {norm} at step {step}, whose loss ({loss:g}) is finite: its gradients overflowed "
                         f"and the update made the parameters inf/NaN; {_REMEDY} (a log, square root or division of "
                         "values near 0 in the loss)")


def parameters_not_finite(step: int) -> ParametersNotFinite:
    return ParametersNotFinite(f"parameters are inf/NaN after step {step}, before its checkpoint (not saved): a step's "
                               f"gradients overflowed while its loss was finite; {_REMEDY}, and trainer.log_every=1 "
                               "finds the step (its grad_norm)")


def parameters_diverged(strategy: Any, model: Any) -> bool:
    """Whether any replica's parameters (any shard of them) are inf or NaN: every rank gets the same answer."""
    if hasattr(model, "param_norm"):  # the variables live elsewhere (parameter servers): their sum of squares
        return not math.isfinite(model.param_norm())
    flags = strategy.run(functools.partial(non_finite_parameters, model))
    return float(strategy.reduce(ReduceOp.MEAN, flags, axis=None)) > 0


def non_finite_parameters(model: Any) -> torch.Tensor:
    """1.0 where a parameter this replica holds (its shard of a split one) is inf or NaN, else 0.0."""
    with torch.no_grad():
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        local = [p for p in local if p.device.type != "meta" and p.is_floating_point()]  # meta: held elsewhere
        if not local:
            return torch.zeros(())
        finite = torch.stack([torch.isfinite(p).all().to(local[0].device) for p in local]).all()
        return (~finite).float()
