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
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from launcher.cluster.process_group import comm_device
from launcher.distribute.reduce_op import ReduceOp

_REMEDY = "lower recipe.optimizer.lr or check the data"


class LossNotFinite(FloatingPointError):
    """The loss became inf or NaN (without fp16's GradScaler, which skips such steps)."""

    explained = True  # the step, the value and what to try: dlaunch's frames add nothing


class ParametersNotFinite(LossNotFinite):
    """The parameters became inf or NaN while the loss read so far was finite: gradients overflowed."""


def loss_not_finite(loss: float, step: int, known: int) -> LossNotFinite:
    """The loss read at step ``step`` is not finite; it may have become so at any step after ``known``, the last one
    known finite (its loss read by a log line or before a save, or the step a resume started from)."""
    since = ""
    if step - known > 1:
        since = (f" (last known finite at step {known}; trainer.log_every=1 finds the first step it is not)" if known else
                 " (trainer.log_every=1 finds the first step it is not)")
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
    """Whether any replica's trainable parameters (any shard of them) are inf or NaN: every rank gets the same answer.

    The strategy's reduce combines its replicas; the processes then agree over the whole job, since a replica may
    span several (a mesh's logical devices each hold a shard, and its reduce runs over the replica dim alone)."""
    if hasattr(model, "param_norm"):  # the variables live elsewhere (parameter servers): their sum of squares
        return not math.isfinite(model.param_norm())
    flags = strategy.run(functools.partial(non_finite_parameters, model))
    flag = torch.as_tensor(strategy.reduce(ReduceOp.MEAN, flags, axis=None), dtype=torch.float32).reshape(1)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag) > 0


def non_finite_parameters(model: Any) -> torch.Tensor:
    """1.0 where a trainable parameter this replica holds (its shard of a split one) is inf or NaN, else 0.0 (a
    frozen one may hold -inf on purpose: a mask)."""
    with torch.no_grad():
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters() if p.requires_grad]
        # meta: held elsewhere; an empty shard (FSDP over more ranks than a tensor has rows) has no inf norm
        local = [p for p in local if p.device.type != "meta" and p.is_floating_point() and p.numel()]
        if not local:
            return torch.zeros(())
        largest = torch.nn.utils.get_total_norm(local, norm_type=math.inf)  # inf or NaN where any element is
        return (~torch.isfinite(largest)).float()
