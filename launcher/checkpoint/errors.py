"""Checkpoint errors, importable without torch.distributed.checkpoint (the launcher reports them)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says which and why."""

    explained = True  # the message is the whole story: no traceback in the root-cause panel


class UnsafeCheckpoint(CheckpointError):
    """The checkpoint holds something other than tensors and DCP metadata (e.g. a pickled callable)."""
