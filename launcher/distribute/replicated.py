"""Mirrored copies of a model inside one process: one copy per local replica.

``MirroredModule`` runs the copy of the replica that calls it; ``MirroredOptimizer``
averages the copies' gradients, then steps every copy, so the copies stay
bitwise identical (TF's mirrored variables).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Sequence

import torch

from launcher.distribute.collectives import ThreadRendezvous
from launcher.distribute.context import get_replica_context


def _local_id(strategy: Any) -> int | None:
    ctx = get_replica_context()
    if ctx is None or ctx.strategy is not strategy:
        return None
    return ctx._local_id


class MirroredModule(torch.nn.Module):
    """Holds the primary module (replica 0) and a copy per other local device."""

    def __init__(self, module: torch.nn.Module, devices: Sequence[torch.device], strategy: Any):
        super().__init__()
        self.module = module.to(devices[0])
        copies = [self.module] + [copy.deepcopy(self.module).to(d) for d in devices[1:]]
        object.__setattr__(self, "replicas", copies)  # not submodules: parameters() is the primary's
        object.__setattr__(self, "_strategy", strategy)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        local = _local_id(self._strategy)
        return self.replicas[local or 0](*args, **kwargs)

    def train(self, mode: bool = True) -> "MirroredModule":
        super().train(mode)
        for replica in self.replicas[1:]:
            replica.train(mode)
        return self


class MirroredOptimizer(torch.optim.Optimizer):
    """One optimizer per replica copy; ``step()`` inside ``strategy.run`` averages gradients first.

    ``param_groups`` and ``state_dict`` are the primary optimizer's, so LR
    schedulers and checkpoints work on it as usual; hyper-parameters are copied
    to the other replicas at every step.
    """

    def __init__(self, primary: torch.optim.Optimizer, module: MirroredModule, rendezvous: ThreadRendezvous):
        # torch.optim.Optimizer.__init__ is not called: this object delegates to real optimizers.
        self._primary = primary
        self._module = module
        self._rendezvous = rendezvous
        self.defaults = primary.defaults
        self.optimizers = [primary] + [_clone_for(primary, module.module, r) for r in module.replicas[1:]]
        self._params = [[p for g in opt.param_groups for p in g["params"]] for opt in self.optimizers]
        self._buffers = [list(r.buffers()) for r in module.replicas]

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self._primary.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._primary.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        local = self._require_replica("step")
        grads = [p.grad for p in self._params[local]]
        self._rendezvous.all_reduce_mean_(local, grads)
        if local != 0:
            _copy_hyperparameters(self._primary, self.optimizers[local])
            for mine, primary in zip(self._buffers[local], self._buffers[0]):
                mine.copy_(primary)
        result = self.optimizers[local].step(closure)
        if self._buffers[0]:
            self._rendezvous.wait()  # replica 0's buffers stay put until every copy has read them
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        local = _local_id(self._module._strategy)
        targets = self.optimizers if local is None else [self.optimizers[local]]
        for opt in targets:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:  # type: ignore[override]
        return self._primary.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        for opt in self.optimizers:
            opt.load_state_dict(state_dict)

    def _require_replica(self, what: str) -> int:
        local = _local_id(self._module._strategy)
        if local is None:
            raise RuntimeError(f"optimizer.{what}() of a mirrored model must be called inside strategy.run()")
        return local

    def __repr__(self) -> str:
        return f"MirroredOptimizer({type(self._primary).__name__}, replicas={len(self.optimizers)})"


def _clone_for(primary: torch.optim.Optimizer, source: torch.nn.Module, replica: torch.nn.Module) -> torch.optim.Optimizer:
    """A fresh optimizer of the same kind and hyper-parameters over ``replica``'s parameters."""
    mapping = {id(p): q for p, q in zip(source.parameters(), replica.parameters())}
    groups = []
    for group in primary.param_groups:
        try:
            params = [mapping[id(p)] for p in group["params"]]
        except KeyError:
            raise ValueError("the optimizer holds parameters that are not the model's") from None
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    # Every setting is in the groups; pass on only the defaults the constructor accepts
    # (AdamW's defaults hold keys its __init__ does not take).
    accepted = inspect.signature(type(primary)).parameters
    return type(primary)(groups, **{k: v for k, v in primary.defaults.items() if k in accepted})


def _copy_hyperparameters(src: torch.optim.Optimizer, dst: torch.optim.Optimizer) -> None:
    for g_src, g_dst in zip(src.param_groups, dst.param_groups):
        for key, value in g_src.items():
            if key != "params":
                g_dst[key] = value
