"""Whole tensors from DTensors, for dlaunch's own reads (norms, metrics, loading into a new layout).

A DTensor split over two mesh dims (FSDP x TP: ``_StridedShard`` then ``Shard``; a
norm's ``_NormPartial`` on both) is made whole in one collective per dim, and torch
logs a warning that this is suboptimal on every rank. For dlaunch's reads (a scalar
norm once a step, the parameters' norm once a run) the extra collective costs
nothing worth a warning, and the user can do nothing about it, so ``whole`` drops
that warning while it runs (``own_reads``: around a norm's whole computation). Torch warns once per mesh, dims and
reason: where dlaunch's read came first, the user's own redistribution over the same dims is not warned of again.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from typing import Any, Iterator

import torch
from torch.distributed.tensor import DTensor

_READING = contextvars.ContextVar("dlaunch_reading_whole", default=False)


class _OwnReads(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_READING.get() and str(record.msg).startswith("While redistributing from"))


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_OwnReads())


@contextlib.contextmanager
def own_reads() -> Iterator[None]:
    """dlaunch's own read of split tensors: torch's warning of a multi-collective redistribution is dropped within."""
    token = _READING.set(True)
    try:
        yield
    finally:
        _READING.reset(token)


def whole(value: Any) -> Any:
    """``value.full_tensor()`` for a DTensor (a collective: every rank of its mesh calls it), else ``value``."""
    if not isinstance(value, DTensor):
        return value
    with own_reads():
        return value.full_tensor()


def param_norm(model: Any, module: Any) -> float:
    """The norm of all of ``module``'s parameters, split layers gathered whole (a collective where any is split);
    variables held elsewhere (``model`` a parameter-server task's) say their own."""
    if hasattr(model, "param_norm"):
        return float(model.param_norm())
    with torch.no_grad():
        return math.sqrt(sum(float(whole(p).detach().float().pow(2).sum()) for p in module.parameters()))
