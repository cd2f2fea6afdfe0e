"""TF's loss convention on torch: ``compute_average_loss`` and ``scale_loss``, and ``get_loss_reduction``.

TF sums gradients across replicas, so a replica's loss is scaled by the *global*
batch: ``sum(per_example_loss) / global_batch_size``. dlaunch's strategies average
gradients (DDP), so their loss is the *replica's* mean. Both give the same update.

A TF loop translated line for line keeps TF's numbers with these helpers: the loss
value is TF's, and its gradient is multiplied by the number of replicas whose
gradients the strategy averages, so that the average equals TF's sum::

    def step_fn(x, y):
        per_example = torch.nn.functional.mse_loss(model(x), y, reduction="none").squeeze(1)
        loss = compute_average_loss(per_example, global_batch_size=8)   # TF's value
        loss.backward()                                                   # TF's update
        optimizer.step()

With 2 replicas of 4 examples each, replica 0's loss is ``sum(l0..l3) / 8``; its
gradient counts twice, the strategy averages the two, and the update is the
gradient of ``sum(l0..l7) / 8``: the one-device mean, as in TF.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from launcher.distribute.reduce_op import ReduceOp

_last = threading.local()  # per thread: each replica thread records its own


class _GradientTimes(torch.autograd.Function):
    """The value unchanged; the gradient multiplied by ``factor`` (the strategy divides it back)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, factor: int) -> torch.Tensor:
        ctx.factor = factor
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad * ctx.factor, None


def _strategy_and_replicas() -> tuple[Any, int]:
    from launcher.distribute.context import get_replica_context, get_strategy

    context = get_replica_context()
    replicas = context.num_replicas_in_sync if context is not None else get_strategy().num_replicas_in_sync
    return get_strategy(), replicas


def _tf_scaled(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` in TF's convention: its gradient undoes the strategy's averaging."""
    strategy, _ = _strategy_and_replicas()
    _last.reduction = ReduceOp.SUM
    averaged_over = strategy.extended._gradients_averaged_over
    return _GradientTimes.apply(loss, averaged_over) if averaged_over > 1 else loss


def compute_average_loss(per_example_loss: torch.Tensor, sample_weight: Any = None,
                         global_batch_size: int | None = None) -> torch.Tensor:
    """``sum(per_example_loss * sample_weight) / global_batch_size``, as ``tf.nn.compute_average_loss``.

    ``global_batch_size`` defaults to this replica's batch times the replicas in
    sync. Inside ``strategy.run`` the gradient then equals TF's (see the module).
    A replica with no rows (a last partial batch) gives 0, as TF's ``div_no_nan``;
    pass the global batch size so that the other replicas' rows weigh as in TF.
    """
    losses = torch.as_tensor(per_example_loss)
    if sample_weight is not None:
        losses = losses * torch.as_tensor(sample_weight, dtype=losses.dtype, device=losses.device)
    if global_batch_size is None:
        _, replicas = _strategy_and_replicas()
        global_batch_size = (losses.shape[0] if losses.dim() else 1) * replicas
        if global_batch_size == 0:  # this replica's share of a last partial batch is empty: it adds nothing
            return _tf_scaled(losses.sum())
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    return _tf_scaled(losses.sum() / global_batch_size)


def scale_loss(loss: torch.Tensor) -> torch.Tensor:
    """A per-replica loss divided by the replicas in sync, as ``tf.nn.scale_regularization_loss`` does.

    For losses that TF scales by the number of replicas (regularization terms,
    or a replica mean a TF loop divides itself); the gradient is TF's.
    """
    _, replicas = _strategy_and_replicas()
    return _tf_scaled(torch.as_tensor(loss) / replicas)


def record_loss_reduction(reduction: ReduceOp | str) -> None:
    """Say how the last loss was reduced (SUM: TF's convention; MEAN: a replica's mean, DDP's)."""
    _last.reduction = ReduceOp.from_any(reduction)


def last_loss_reduction() -> ReduceOp:
    return getattr(_last, "reduction", ReduceOp.MEAN)
