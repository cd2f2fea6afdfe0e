"""Gradient accumulation without a sync per micro-batch: DDP's ``no_sync`` and FSDP2's gradient sync switch.

A backward inside ``no_sync(model)`` leaves this rank's gradients unsynced
(accumulated locally, unsharded under FSDP2); the next backward outside it
syncs them all at once. Strategies that sync elsewhere need nothing here: the
mesh's replicas average at the optimizer's step, replica threads of one process
share their gradients, so for them it changes nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


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
