"""Gradient accumulation without a sync per micro-batch: DDP's ``no_sync`` and FSDP2's gradient sync switch.

A backward inside ``no_sync(model)`` leaves this rank's gradients unsynced
(accumulated locally, unsharded under FSDP2); the next backward outside it
syncs them all at once. Strategies that sync elsewhere need nothing here: the
mesh's replicas average at the optimizer's step, replica threads of one process
share their gradients, so for them it changes nothing.

``watched(model)`` is the script API's form (``strategy.no_sync``): it also stops
an ``optimizer.step()`` whose last backward did not sync, the one mistake of
accumulation that no error shows (the last micro-batch inside it too): DDP
decides at forward time, so a step whose last training forward ran inside it
would move each rank its own way; FSDP2 decides at backward and would leave that
backward's gradients out of the sharded ones (all of them: a step that changes nothing).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook  # torch.optim deletes its submodules' names


def no_sync(model: Any) -> contextlib.AbstractContextManager:
    """The model's own ``no_sync`` (DDP), FSDP2's ``set_requires_gradient_sync(False)``, or nothing to do."""
    own = getattr(model, "no_sync", None)
    if own is not None:
        return own()
    if hasattr(model, "set_requires_gradient_sync"):
        return _no_gradient_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _no_gradient_sync(model: Any) -> Iterator[None]:
    """FSDP2's ``no_sync``: gradients accumulate unsharded on each rank until a backward that syncs."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class UnsyncedStep(RuntimeError):
    """``optimizer.step()`` on gradients that ``strategy.no_sync`` kept from being synced."""


def watched(model: Any, check: bool = True) -> contextlib.AbstractContextManager:
    """``no_sync(model)``, and (``check``) a check at the optimizer's next step that the step's last backward synced."""
    inner = no_sync(model)
    if not check or isinstance(inner, contextlib.nullcontext):  # nothing synced here: nothing can be left unsynced
        return inner
    watch = _WATCHES.get(model)
    if watch is None:
        watch = _WATCHES[model] = _Watch(model)
    return watch.block(inner)


class _Watch:
    """Whether the last backward through one model, since its optimizer last stepped, ran without its sync."""

    def __init__(self, model: Any):
        self.at_forward = hasattr(model, "no_sync")  # DDP reads the switch at forward, FSDP2 at backward
        self.ids = frozenset(id(p) for p in model.parameters() if p.requires_grad)
        self.open = 0  # no_sync blocks entered and not yet left
        self.last_backward_unsynced = False
        model.register_forward_hook(self._forward)
        _install_step_hook()

    @contextlib.contextmanager
    def block(self, inner: contextlib.AbstractContextManager) -> Iterator[None]:
        self.open += 1
        try:
            with inner:
                yield
        finally:
            self.open -= 1

    @torch.compiler.disable
    def _forward(self, module: Any, args: Any, output: Any) -> None:
        """Only a forward that is backpropagated counts (one run under no_sync for a metric alone does not). Its
        output's gradient arrives as the backward through the model starts: DDP's switch as it was at the forward,
        FSDP2's as it is now, is whether that backward syncs."""
        at_forward = self.open > 0
        for out in _tensors(output):  # every output that trains: the loss may come from any of them
            if out.requires_grad:
                out.register_hook(lambda grad: setattr(self, "last_backward_unsynced",
                                                       at_forward if self.at_forward else self.open > 0))

    def check(self) -> None:
        """Called before the optimizer steps; the next step's check starts afresh."""
        unsynced, self.last_backward_unsynced = self.last_backward_unsynced, False
        if unsynced:
            how = ("DDP synced none of its gradients: each rank would step on its own and the replicas drift apart"
                   if self.at_forward else "FSDP2 reduced none of its gradients into the sharded parameters: "
                   "the step would leave them out")
            raise UnsyncedStep(
                f"optimizer.step() after a backward inside strategy.no_sync(model): {how}. Step the optimizer "
                "(and a scheduler) only after the last micro-batch, and keep that micro-batch's forward and backward "
                "out of no_sync, e.g. `with strategy.no_sync(model, enabled=not last):` (a script that all-reduces "
                "the gradients itself: `strategy.no_sync(model, check=False)`)")


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors of a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        yield output
        return
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for item in items:
        yield from _tensors(item)


_WATCHES: "weakref.WeakKeyDictionary[Any, _Watch]" = weakref.WeakKeyDictionary()
_hook: Any = None


def _install_step_hook() -> None:
    """One hook for every optimizer of the process: only those that step a watched model's parameters check."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _WATCHES:
        return
    firsts = {id(group["params"][0]) for group in optimizer.param_groups if group["params"]}
    for watch in list(_WATCHES.values()):
        if firsts & watch.ids:
            watch.check()
