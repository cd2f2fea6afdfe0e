"""``trainer.activation_checkpointing``: named module classes recompute their forward in backward.

Each instance of a named class keeps no activations from its forward but its inputs; backward runs its forward
again (``torch.utils.checkpoint``, non-reentrant) to get them. Memory for compute: a transformer's blocks are the
usual choice. The module's ``forward`` is replaced on the instance, not wrapped in a new module, so parameter
names, ``state_dict`` keys, checkpoints, ``strategy.wrap`` and mesh rules see the model unchanged. It runs inside
any hooks on the module (FSDP2's gather, DTensor's redistribution), so the recompute finds the parameters the
forward found. Under ``torch.compile`` dynamo turns the call into torch's checkpoint operator, and the partitioner
recomputes what it would have saved.

Eagerly the recomputed forward is the same computation, the RNG state (dropout) restored, so losses and gradients
are the same as without it, bit for bit; compiled, they are the same as compiled without it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


class UnknownModuleClass(ValueError):
    """A setting names a module class the model does not contain."""

    explained = True  # the message names the model's module types: dlaunch's frames add nothing


def instances(module: torch.nn.Module, names: Sequence[str], key: str,
              error: type[ValueError] = UnknownModuleClass) -> list[torch.nn.Module]:
    """Every submodule (not ``module`` itself) whose class is named in ``names``, parents before children; ``error``
    names ``key``, the missing names and the model's module types when one of ``names`` matches nothing."""
    types_ = sorted(types_in(module))
    missing = [name for name in names if name not in types_]
    if missing:
        raise error(f"{key} names {', '.join(missing)}, but {type(module).__name__} contains no module of "
                    f"that class; its module types are: {', '.join(types_)}")
    return [m for m in module.modules() if type(m).__name__ in names and m is not module]


KEY = "trainer.activation_checkpointing"


class NotRecomputable(ValueError):
    """A named module whose recompute would not be the forward it replays (running statistics, its own forward)."""

    explained = True


def apply(module: torch.nn.Module, names: Sequence[str], strict: bool = True) -> int:
    """Recompute the forward of every instance of a class in ``names`` in backward; how many there are.

    ``strict``: a name ``module`` lacks raises ``UnknownModuleClass`` (a recipe's one model); otherwise it is
    skipped (a script may prepare several models, each with some of the classes). An instance inside another
    recomputed one is left alone: its parent's recompute already covers it. Applying twice changes nothing.
    A shallow copy (``copy.copy``, ``nn.parallel.replicate``) would run the original's forward: copy deeply.
    A whole-model pickle keeps the recompute, and loads where this module can be imported."""
    if isinstance(names, str):
        raise TypeError(f"activation_checkpointing takes a list of module class names, not the string {names!r}")
    if not names:
        return 0
    root = type(module).__name__
    if root in names and not any(type(m).__name__ == root for m in module.modules() if m is not module):
        raise NotRecomputable(f"{KEY} names {root}, the model itself: its recompute in backward would hold all its "
                              f"activations at once, as its forward does; name the classes of its blocks")
    present = types_in(module)
    found = instances(module, names if strict else [name for name in names if name in present], KEY)
    inside = {id(sub) for m in found for sub in m.modules() if sub is not m}
    chosen = [m for m in found if id(m) not in inside]
    paths = {id(m): path for path, m in module.named_modules()}
    for m in chosen:
        _check_recomputable(m, paths[id(m)])
        # a partial, not a bound method: a whole-model pickle (torch.save(model)) rebuilds it by name, and deepcopy
        # (mirrored's replicas) binds the copy
        m.forward = functools.partial(_recomputed_forward, m)
    return len(chosen)


def _check_recomputable(m: torch.nn.Module, path: str) -> None:
    """Refuse what the recompute would get wrong: a forward set on the instance (it would be bypassed), and
    running statistics (batch norm's would be updated a second time each step)."""
    cls = type(m).__name__
    own = m.__dict__.get("forward")
    if own is not None and not _is_recomputed(own):
        raise NotRecomputable(f"{KEY}: {path} ({cls}) has a forward set on the instance, which the recompute would "
                              f"bypass; set it after strategy.prepare(), or leave {cls} out")
    stats = [f"{sub_path} ({type(sub).__name__})" for sub_path, sub in m.named_modules(prefix=path)
             if isinstance(sub, torch.nn.modules.batchnorm._NormBase) and sub.track_running_stats]
    if stats:
        raise NotRecomputable(f"{KEY}: {path} ({cls}) holds {', '.join(stats[:3])}, whose running statistics the "
                              f"recompute would update a second time each step; name classes without batch norm")


def types_in(module: torch.nn.Module) -> set[str]:
    """The class names of ``module`` and its submodules."""
    return {type(m).__name__ for m in module.modules()}


def _recomputed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The class's ``forward`` under ``torch.utils.checkpoint`` while training with gradients; as is otherwise
    (evaluation, ``no_grad``), where there is nothing to save. Keyword arguments reach ``checkpoint`` as positional
    ones: it saves the RNG state of the devices of those alone, and it would take a keyword of its own (``debug``)."""
    forward = type(self).forward
    if not (self.training and torch.is_grad_enabled()):
        return forward(self, *args, **kwargs)
    keys = tuple(kwargs)

    def replay(*inputs: Any) -> Any:
        cut = len(inputs) - len(keys)
        return forward(self, *inputs[:cut], **dict(zip(keys, inputs[cut:])))

    return checkpoint(replay, *args, *kwargs.values(), use_reentrant=False)


def checkpointed(module: torch.nn.Module) -> int:
    """How many of ``module``'s submodules recompute their forward in backward (for the run's log)."""
    return sum(1 for m in module.modules() if _is_recomputed(m.__dict__.get("forward")))


def _is_recomputed(forward: Any) -> bool:
    return isinstance(forward, functools.partial) and forward.func is _recomputed_forward
