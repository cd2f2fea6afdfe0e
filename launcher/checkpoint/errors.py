"""Checkpoint errors, importable without torch.distributed.checkpoint (the launcher reports them)."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says which and why."""

    explained = True  # the message is the whole story: no traceback in the root-cause panel


class UnsafeCheckpoint(CheckpointError):
    """The checkpoint holds something other than tensors and DCP metadata (e.g. a pickled callable)."""


class NoIntactCheckpoint(CheckpointError):
    """Checkpoints were found to resume from, and every one of them is damaged."""

    def __init__(self, skipped: tuple[tuple[Path, str], ...]):
        self.skipped = skipped
        listed = "; ".join(f"{path}: {why}" for path, why in skipped)
        super().__init__(f"no intact checkpoint to resume from; found {len(skipped)}, all damaged ({listed}); "
                         f"{START_AFRESH}")


START_AFRESH = ("start afresh with trainer.resume=never (the damaged ones are moved aside, not deleted), "
                "or resume from another checkpoint with trainer.resume=PATH")
