"""Modules built in a parameter-server ``scope()`` get meta parameters: shapes, no values.

Their values live on the ps tasks; data built in the same scope stays real::

    with variables_scope():
        table = torch.nn.Embedding(1_000_000, 64)    # table.weight.is_meta
        batch = torch.randn(3, 4)                    # a real tensor
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = frozenset({
    torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint, torch.normal,
    torch.arange, torch.eye, torch.tensor, torch.as_tensor,
})


class _ModulesOnMeta(TorchFunctionMode):
    """Inside ``scope()``: tensors a module's ``__init__`` creates (its parameters and buffers) are meta tensors.

    Their values live on the ps tasks; the data a recipe builds in the same scope stays real.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and _in_module_init():
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _in_module_init(depth: int = 12) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), torch.nn.Module):
            return True
        frame = frame.f_back
    return False


class MetaScope:
    def __init__(self, inner: Any):
        self.inner, self.mode = inner, _ModulesOnMeta()

    def __enter__(self) -> None:
        self.inner.__enter__()
        self.mode.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        self.mode.__exit__(*exc)
        return self.inner.__exit__(*exc)


def variables_scope() -> MetaScope:
    """Modules built inside get meta parameters (shapes, no values); other tensors stay real."""
    return MetaScope(contextlib.nullcontext())


