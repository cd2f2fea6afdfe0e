"""Mirrored copies of a model inside one process: one copy per local replica.

``MirroredModule`` runs the copy of the replica that calls it. When a replica's
backward pass ends, the copies' gradients are averaged by the strategy's
cross-device ops (as DDP does across processes, so ``clip_grad_norm_`` and
friends see averaged gradients) and the buffers are copied from replica 0.
``MirroredOptimizer`` then steps every copy, so the copies stay bitwise
identical (TF's mirrored variables).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, Iterator, Sequence

import torch

from launcher.distribute.collectives import ThreadRendezvous
from launcher.distribute.context import get_replica_context


def _local_id(strategy: Any) -> int | None:
    ctx = get_replica_context()
    if ctx is None or ctx.strategy is not strategy:
        return None
    return ctx._local_id


class ReplicaParameters(torch.nn.Module):
    """A module with one replica module per local replica (``replicas``) besides its own ``module``.

    Inside ``strategy.run`` ``parameters()`` are the calling replica's, so
    ``clip_grad_norm_(model.parameters())`` acts on that replica's gradients.
    """

    module: torch.nn.Module
    replicas: list[torch.nn.Module]
    _strategy: Any

    def parameters(self, recurse: bool = True) -> Any:
        """Inside ``strategy.run``: this replica's module (so clip_grad_norm_ etc. act on it)."""
        return self._current().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        local = _local_id(self._strategy)
        if local is None:
            return super().named_parameters(*args, **kwargs)
        return self.replicas[local].named_parameters(*args, **kwargs)

    def _current(self) -> torch.nn.Module:
        local = _local_id(self._strategy)
        return self.module if local is None else self.replicas[local]

    def local_copies(self, param: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Each local replica's copy of primary parameter ``param`` (TF's mirrored components), or None if not ours."""
        name = next((n for n, p in self.module.named_parameters() if p is param), None)
        if name is None:
            return None
        return tuple(dict(r.named_parameters())[name] for r in self.replicas)


class MirroredModule(ReplicaParameters):
    """Holds the primary module (replica 0) and a copy per other local device."""

    def __init__(
        self, module: torch.nn.Module, devices: Sequence[torch.device], strategy: Any, rendezvous: ThreadRendezvous,
        cross_device_ops: Any,
    ):
        super().__init__()
        self.module = module.to(devices[0])
        copies = [self.module] + [copy.deepcopy(self.module).to(d) for d in devices[1:]]
        object.__setattr__(self, "replicas", copies)  # not submodules: parameters() is the primary's
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "_rendezvous", rendezvous)
        object.__setattr__(self, "_cross_device_ops", cross_device_ops)  # how the copies' gradients are combined
        object.__setattr__(self, "_pending", [False] * len(copies))
        object.__setattr__(self, "_in_run", [False] * len(copies))  # forward ran inside strategy.run
        for local, replica in enumerate(copies):
            for p in replica.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda _p, local=local: self._gradient_ready(local))

    def _gradient_ready(self, local: int) -> None:
        """Once per backward pass: average gradients when the whole pass has finished.

        Only for passes whose forward ran inside ``strategy.run`` (every replica then
        takes part); the flag is set by ``forward`` because on CUDA autograd runs the
        backward on its own threads, which know nothing of the replica context.
        """
        if self._in_run[local] and not self._pending[local]:
            self._pending[local] = True
            # The hook DDP itself uses: run after autograd has accumulated every gradient.
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._sync(local))

    def _sync(self, local: int) -> None:
        self._pending[local] = self._in_run[local] = False
        grads = [p.grad for p in self.replicas[local].parameters()]
        self._rendezvous.all_reduce_mean_(local, grads, self._cross_device_ops, meanwhile=lambda: self._copy_buffers(local))

    def _copy_buffers(self, local: int) -> None:
        # Every replica's forward is over (they are all in backward's end), so replica 0's
        # buffers (e.g. BatchNorm statistics) are stable: the same role as DDP's broadcast.
        if local != 0:
            with torch.no_grad():
                for mine, primary in zip(self.replicas[local].buffers(), self.module.buffers()):
                    mine.copy_(primary)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        local = _local_id(self._strategy)
        if local is None:
            return self.module(*args, **kwargs)
        self._in_run[local] = True
        return self.replicas[local](*args, **kwargs)

    def resync(self) -> None:
        """Make every copy equal to replica 0 again (after a step failed on some replicas)."""
        self._pending[:] = [False] * len(self.replicas)
        self._in_run[:] = [False] * len(self.replicas)
        with torch.no_grad():
            for replica in self.replicas[1:]:
                for mine, primary in zip(replica.parameters(), self.module.parameters()):
                    mine.copy_(primary)
                for mine, primary in zip(replica.buffers(), self.module.buffers()):
                    mine.copy_(primary)

    def train(self, mode: bool = True) -> "MirroredModule":
        super().train(mode)
        for replica in self.replicas[1:]:
            replica.train(mode)
        return self


def check_own_parameters(optimizer: torch.optim.Optimizer, model: torch.nn.Module, why: str = "") -> None:
    """Refuse an optimizer over tensors the model does not hold: the strategy hands it the model's own copies."""
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
    if foreign:
        raise ValueError(f"the optimizer holds {foreign} parameter(s) that are not the model's{why}")


class DelegatingOptimizer(torch.optim.Optimizer):
    """Wraps a real optimizer (``primary``): its param groups, state and state dict are this one's."""

    def __init__(self, primary: torch.optim.Optimizer):
        # torch.optim.Optimizer.__init__ is not called: this object delegates to real optimizers.
        self._primary = primary
        self.defaults = primary.defaults

    @property
    def primary(self) -> torch.optim.Optimizer:
        """The optimizer that checkpoints save and load."""
        return self._primary

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self._primary.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._primary.state

    def state_dict(self) -> dict:  # type: ignore[override]
        return self._primary.state_dict()


class MirroredOptimizer(DelegatingOptimizer):
    """One optimizer per replica copy; ``step()`` inside ``strategy.run`` steps this replica's copy.

    ``param_groups`` and ``state_dict`` are the primary optimizer's (replica 0's), so LR
    schedulers and checkpoints work on it as usual; hyper-parameters are copied
    to the other replicas at every step.
    """

    def __init__(self, primary: torch.optim.Optimizer, module: MirroredModule):
        super().__init__(primary)
        self._module = module
        self.optimizers = [primary] + [_clone_for(primary, module.module, r) for r in module.replicas[1:]]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        local = self._require_replica("step")
        if local != 0:
            _copy_hyperparameters(self._primary, self.optimizers[local])
        return self.optimizers[local].step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        local = _local_id(self._module._strategy)
        targets = self.optimizers if local is None else [self.optimizers[local]]
        for opt in targets:
            opt.zero_grad(set_to_none=set_to_none)

    def resync(self) -> None:
        """Give every copy's optimizer replica 0's state again."""
        state = self._primary.state_dict()
        for opt in self.optimizers[1:]:
            opt.load_state_dict(state)

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
    check_own_parameters(primary, source)
    mapping = {id(p): q for p, q in zip(source.parameters(), replica.parameters())}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [mapping[id(p)] for p in group["params"]]}
              for group in primary.param_groups]
    # Every setting is in the groups; pass on only the defaults the constructor accepts
    # (AdamW's defaults hold keys its __init__ does not take).
    accepted = inspect.signature(type(primary)).parameters
    return type(primary)(groups, **{k: v for k, v in primary.defaults.items() if k in accepted})


def _copy_hyperparameters(src: torch.optim.Optimizer, dst: torch.optim.Optimizer) -> None:
    for g_src, g_dst in zip(src.param_groups, dst.param_groups):
        for key, value in g_src.items():
            if key != "params":
                g_dst[key] = value


@contextlib.contextmanager
def one_optimizer_per_replica(strategy: Any) -> Iterator[None]:
    """Around ``strategy.run`` on replica threads: an optimizer that two replicas step, in a strategy that never
    prepared a model, is one model shared by them (TF mirrors what ``scope()`` creates; here the copies come from
    ``prepare``). Each replica would update the same parameters in turn while another reads them in its forward:
    racy, wrong numbers, no error. The second replica's step raises instead. One hook for the process (torch's global
    hooks are iterated by every optimizer step on every thread: none is added or removed per run)."""
    global _HOOKED
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_one_replica_steps_it)
        _HOOKED = True
    strategy._stepped_in_run = {}
    try:
        yield
    finally:
        strategy._stepped_in_run = None


_HOOKED = False


def _one_replica_steps_it(optimizer: Any, *_: Any) -> None:
    ctx = get_replica_context()
    strategy = ctx.strategy if ctx is not None else None
    stepped = getattr(strategy, "_stepped_in_run", None)
    if stepped is None or getattr(strategy, "_prepared", False) or isinstance(optimizer, DelegatingOptimizer):
        return  # not in a run on threads; or prepare's copies (a wrapper of its optimizer too)
    if stepped.setdefault(id(optimizer), ctx._local_id) != ctx._local_id:
        raise RuntimeError(
            f"optimizer.step() of one {type(optimizer).__name__} ran on two of the {strategy.num_replicas_in_sync} "
            "replica threads: they share one model, each updating its parameters while another reads them (racy, "
            "wrong numbers). Give the model and optimizer to strategy.prepare(model, optimizer) inside scope(): "
            "each replica then steps its own synced copy (docs/API.md)")
