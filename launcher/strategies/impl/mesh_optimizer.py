"""The mesh strategy's optimizer: the gradients averaged over the replica dimension before the update.

Each replica of ``MeshStrategy`` computes its gradients alone (its logical devices
may split layers as DTensors); ``MeshOptimizer`` averages them over the
``replica`` process group with one flat all-reduce, then steps the user's optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from launcher.distribute.grad_norm import clip_grad_norm
from launcher.distribute.replicated import DelegatingOptimizer


class MeshOptimizer(DelegatingOptimizer):
    """``step()`` first averages the gradients over the replica dimension (one flat all-reduce), then steps.

    ``clip_grad_norm_`` averages them first too (once per step), so the norm and the clip are the average's.
    """

    def __init__(self, primary: torch.optim.Optimizer, replica_group: Any, replicas: int):
        super().__init__(primary)
        self._group, self._replicas = replica_group, replicas
        self._averaged = False  # this step's gradients are the replicas' average already

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self._average_once()
        self._averaged = False
        return self._primary.step(closure)

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor | None:
        """The norm of the averaged gradients; clipped to ``max_norm`` when given (split layers count whole)."""
        self._average_once()
        return clip_grad_norm((p for g in self._primary.param_groups for p in g["params"]), max_norm)

    def _average_once(self) -> None:
        if self._replicas > 1 and not self._averaged:
            self._average_gradients()
        self._averaged = True

    def _average_gradients(self) -> None:
        grads = [_local(p.grad) for g in self._primary.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self._group)
        flat /= self._replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._averaged = False  # a step GradScaler skipped: the next gradients are new
        self._primary.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        self._primary.load_state_dict(state_dict)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
