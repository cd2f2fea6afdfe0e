"""Whether a directory a setting names can be made: asked of the file system before anything starts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def unusable_dir(value: str) -> str | None:
    """Why a directory cannot be made at ``value`` (up to its first interpolation); None if it can.

    Permissions alone do not tell: root may write anywhere yet make nothing under ``/proc``. So a writable
    ancestor is asked to hold a directory, which is removed at once.
    """
    fixed = value.split("${")[0]
    path = Path(fixed or ".").expanduser()
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        if existing == path and fixed == value:
            return f"{path} exists and is not a directory"
        return f"{existing} is not a directory, so nothing can be made under it"
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        return f"cannot write under {existing} ({'read-only file system' if read_only else 'permission denied'})"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dlaunch-probe-", dir=existing))
    except OSError as exc:
        return f"cannot make a directory under {existing} ({exc.strerror or exc})"
    return None
