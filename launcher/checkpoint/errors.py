"""Checkpoint errors, importable without torch.distributed.checkpoint (the launcher reports them)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says which and why."""

    explained = True  # the message is the whole story: no traceback in the root-cause panel


class StopNotSaved(CheckpointError):
    """The save of a stop signal was refused (``trainer.checkpoint.on_error=error``): the run ends as failed, and a
    restart (``launch.max_restarts``) would train on against the stop that was asked for."""

    ends_run = True  # read by the worker into its error file: the agent does not restart


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


# What torch's zip writer (torch.save, a rank's DCP file) says when a write of its failed: the OSError is gone by then
_FAILED_WRITES = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")
NEARLY_FULL_BYTES = 1 << 20  # a file system with less free than this refused the write for space


def storage_refusal(exc: BaseException, root: Path) -> OSError | None:
    """The storage's refusal behind a failed save (None: another failure, which is not the storage's).

    DCP reports each rank's failure: an ``OSError`` on any of them (rank 1's ``ENOSPC``) is the cause, though rank 0's
    may be torch's zip writer failing after its write did (``unexpected pos 704 vs 598``), which keeps no errno: that
    alone, on a file system with under a MiB free, is a full disk too."""
    failures = getattr(exc, "failures", None)
    causes = [failure[0] for failure in failures.values()] if failures else [exc]
    for cause in causes:
        while cause is not None:
            if isinstance(cause, OSError) and not isinstance(cause, (ConnectionError, TimeoutError)):  # a peer's
                return cause  # lost connection is no refusal of the storage's
            cause = cause.__cause__ or cause.__context__
    failed_write = any(any(sign in str(c) for sign in _FAILED_WRITES) for c in causes)
    if failed_write and _free_bytes(root) < NEARLY_FULL_BYTES:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # where: the message names the directory
    return None


def _free_bytes(root: Path) -> int:
    for where in (root, *root.parents):  # the checkpoint directory, or the nearest folder above it that exists
        try:
            return shutil.disk_usage(where).free
        except OSError:
            continue
    return NEARLY_FULL_BYTES


def cause_of(exc: BaseException) -> BaseException:
    """DCP wraps each rank's failure: the first one."""
    failures = getattr(exc, "failures", None)
    return next(iter(failures.values()))[0] if failures else exc


def explain_load(exc: BaseException, path: Path, wanted: set[str], saved: set[str]) -> CheckpointError:
    """A failed load in words. ``wanted``: the model's state names; ``saved``: the checkpoint's model names."""
    cause = cause_of(exc)
    if isinstance(cause, CheckpointError):
        return cause
    text = " ".join(str(cause).split()) or type(cause).__name__
    if "Weights only load failed" in text or "UnpicklingError" in type(cause).__name__:
        return UnsafeCheckpoint(f"{path} holds data that is not plain tensors; it was not loaded ({text[:200]})")
    if "Size mismatch" in text or "size mismatch" in text or "Missing key" in text:
        missing, extra = sorted(wanted - saved), sorted(saved - wanted)
        names = "" if not missing else (
            f"; the model has {_some(missing)} that the checkpoint lacks" + (
                f", and the checkpoint holds {_some(extra)} that the model lacks (a module renamed?)" if extra else ""))
        return CheckpointError(f"{path} does not fit this run's model or optimizer ({text[:300]}){names}; did a recipe "
                               "setting that shapes them change? (the plan lists what changed since the checkpoint) To "
                               "train the new shape from step 0 instead, add trainer.resume=never or use another hydra.run.dir")
    return CheckpointError(f"cannot load {path}: {type(cause).__name__}: {text[:300]}")


def _some(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 5 more``."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
