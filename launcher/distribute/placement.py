"""Where the parameters of modules built in ``strategy.scope()`` land.

TF places the variables created in a strategy's scope on the strategy's
devices and leaves every other tensor alone. The obvious torch translation,
``torch.set_default_device`` for the scope, gets the second half wrong: every
tensor the user's code makes inside the scope moves too, so a CPU generator
fails (``Expected a 'cuda' device type for generator``), data built there lands
on the GPU, and parameters are initialised by the device's RNG, so one seed
gives different initial weights on CPU and on CUDA.

Here modules are built exactly as outside a scope: on the CPU, from the seeded
CPU RNG. torch's registration hooks note each module that gains a parameter, a
buffer or a submodule while the scope is open (on this thread); when the scope
closes, those modules' tensors (and a registered submodule's whole tree: layers
copied with ``copy.deepcopy``, as ``nn.TransformerEncoder`` makes them, register
nothing themselves) move to the strategy's device in place (``Module._apply``,
so CPU-to-CUDA moves keep the ``Parameter`` objects an optimizer already holds).
The same seed therefore gives the same initial parameters on every device type,
and only parameters and buffers move.

A ``meta`` device is allowed: building under it checks what a recipe creates
without allocating (the CPU test of "every recipe builds on a non-CPU device").
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.nn.modules import module as module_lib

_local = threading.local()
# id of a variable made in ``colocate_vars_with(v)`` -> (a reference to it, one to ``v``). Beside the tensors, not
# on them: a weak reference in a tensor's __dict__ would stop it from being pickled (torch.save(model)).
_colocated: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_hooks: list[Any] = []
_hooks_lock = threading.Lock()


class Placement:
    """Context manager: modules given parameters or buffers inside it move to ``device`` when it closes.

    Placements nest on a thread: a module belongs to the innermost open one
    (``colocate_vars_with`` inside ``scope()``).

        with Placement(torch.device("cuda", 0)):
            model = torch.nn.Linear(4, 1)   # made and initialised on the CPU
        model.weight.device                  # cuda:0
    """

    def __init__(self, device: torch.device, colocate_with: torch.Tensor | None = None):
        self.device = device
        self.colocate_with = colocate_with  # ``colocate_vars_with``: marked so that a ps placement follows it too
        self._owners: dict[int, weakref.ref] = {}  # modules whose own tensors move
        self._trees: dict[int, weakref.ref] = {}  # submodules registered here: their whole tree moves
        self._made: list[torch.Tensor] = []  # under colocate_with: the parameters and buffers registered here

    def __enter__(self) -> "Placement":
        _install_hooks()
        _stack().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _stack().remove(self)
        owners = {id(m): m for m in (ref() for ref in self._owners.values()) if m is not None}
        trees = {}
        for tree in (ref() for ref in self._trees.values()):
            trees.update((id(m), m) for m in (tree.modules() if tree is not None else ()))
        self._owners.clear()
        self._trees.clear()
        if self.colocate_with is not None:  # the tensors registered here, and those of the submodules registered here
            made = [*self._made, *(t for m in trees.values() for t in [*m._parameters.values(), *m._buffers.values()])]
            for t in made:
                if t is not None and t is not self.colocate_with:
                    key = id(t)
                    _colocated[key] = (weakref.ref(t, lambda _, key=key: _colocated.pop(key, None)),
                                       weakref.ref(self.colocate_with))
        self._made.clear()
        for module in {**owners, **trees}.values():
            move(module, self.device)

    def note(self, module: torch.nn.Module, value: torch.Tensor | None = None) -> None:
        self._owners.setdefault(id(module), weakref.ref(module))
        if self.colocate_with is not None and value is not None:
            self._made.append(value)

    def note_tree(self, module: torch.nn.Module) -> None:
        self._trees.setdefault(id(module), weakref.ref(module))


def settle(module: torch.nn.Module) -> None:
    """Inside an open placement: move ``module``'s tree now (``strategy.prepare`` inside ``scope()``
    needs the parameters where they will train before it wraps them or aligns the optimizer's state)."""
    stack = getattr(_local, "stack", None)
    if stack:
        for sub in module.modules():
            move(sub, stack[-1].device)


def colocated_with(t: torch.Tensor) -> torch.Tensor | None:
    """The variable ``t`` was created to live beside (``colocate_vars_with``), if it is still alive."""
    mine, anchor = _colocated.get(id(t), (None, None))
    return anchor() if mine is not None and mine() is t else None


def target() -> torch.device | None:
    """Where the innermost placement open on this thread moves parameters (None outside every scope)."""
    stack = getattr(_local, "stack", None)
    return stack[-1].device if stack else None


def move(module: torch.nn.Module, device: torch.device) -> None:
    """``module``'s own parameters and buffers (not its children's) onto ``device``, in place.

    Tensors already there, DTensors (their mesh decides where they live) and meta tensors (shapes
    whose values live elsewhere, as a parameter server's do) stay.
    """
    def needs_move(t: torch.Tensor | None) -> bool:
        return t is not None and t.device != device and t.device.type != "meta" and not _is_dtensor(t)

    own = [*module._parameters.values(), *module._buffers.values()]
    if any(needs_move(t) for t in own):
        module._apply(lambda t: t if not needs_move(t) else t.to(device), recurse=False)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"  # no DTensor import (and its half second) for plain modules


def _stack() -> list[Placement]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _noted(module: torch.nn.Module, name: str, value: Any) -> None:
    stack = getattr(_local, "stack", None)
    if stack and value is not None:
        stack[-1].note(module, value)


def _noted_tree(module: torch.nn.Module, name: str, submodule: Any) -> None:
    stack = getattr(_local, "stack", None)
    if stack and submodule is not None:
        stack[-1].note_tree(submodule)


def _install_hooks() -> None:
    """torch's registration hooks are process-wide; one pair serves every thread's placements."""
    with _hooks_lock:
        if not _hooks:
            _hooks.append(module_lib.register_module_parameter_registration_hook(_noted))
            _hooks.append(module_lib.register_module_buffer_registration_hook(_noted))
            _hooks.append(module_lib.register_module_module_registration_hook(_noted_tree))
