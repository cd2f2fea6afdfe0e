"""``trainer.precision`` as torch runs it: autocast's dtype and fp16's GradScaler.

dlaunch's loop and a script's own loop take them from here: the loop through
``ReplicaStep``, a script through ``strategy.autocast()`` and
``strategy.grad_scaler()``. Autocast is per thread, so replica threads (mirrored
on several devices of one process) enter the autocast their caller is in
(``inherited_autocast``), as replica 0, which runs on the caller's thread, does.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

DTYPES = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def autocast(precision: str, device_type: str, cache: bool = True) -> contextlib.AbstractContextManager:
    """``torch.autocast`` in ``precision``'s dtype on ``device_type``; nothing for fp32. ``cache=False``: no cast
    of a weight is kept for the region's length (torch keeps them, and would not see a weight changed in place)."""
    dtype = DTYPES[precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype, cache_enabled=cache)


def grad_scaler(precision: str, device_type: str) -> torch.amp.GradScaler:
    """fp16-mixed's GradScaler; under any other precision a disabled one, whose ``scale``, ``unscale_``, ``step``
    and ``update`` pass the loss and the optimizer through, so one loop serves every precision."""
    return torch.amp.GradScaler(device_type, enabled=precision == "fp16-mixed")


def inherited_autocast(device_type: str) -> torch.dtype | None:
    """The autocast dtype the calling thread is in on ``device_type`` (None: none), for threads it starts work on."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def unscale_once(scaler: torch.amp.GradScaler, optimizer: Any) -> None:
    """``scaler.unscale_(optimizer)``, unless it was called since the last ``update()`` (torch refuses a second)."""
    try:
        scaler.unscale_(optimizer)
    except RuntimeError as exc:
        if "unscale_() has already been called" not in str(exc):
            raise
