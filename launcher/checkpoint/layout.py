"""A checkpoint directory: complete steps, the ``latest`` marker, partial saves.

    CHECKPOINTS/
      latest                    "step-00000120": moves only after every rank wrote that step
      step-00000100/            DCP files (.metadata, __N_0.distcp) + manifest.json
      step-00000120/
      .step-00000140.partial/   a save in progress (or one killed midway): never read

A save writes into ``.step-N.partial``, rank 0 adds ``manifest.json`` once DCP
reports every rank's files written, renames the directory to ``step-N`` (one
atomic rename) and only then rewrites ``latest`` (write + ``os.replace``). So a
process killed at any moment leaves ``latest`` naming a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from launcher.checkpoint.safe import CheckpointError

LATEST = "latest"
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".step-{step:08d}.partial"


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file() and (path / ".metadata").is_file()


def complete_steps(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest(root: Path) -> Path | None:
    """The checkpoint ``latest`` names; without a usable marker, the newest complete one."""
    try:
        named = root / (root / LATEST).read_text().strip()
        if _STEP.match(named.name) and is_complete(named):
            return named
    except OSError:
        pass
    steps = complete_steps(root)
    return steps[-1] if steps else None


def resolve(resume: str, root: Path) -> Path | None:
    """The checkpoint ``trainer.resume`` (auto | never | PATH) selects; None: start afresh."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest(root)
    path = Path(resume)
    if is_complete(path):
        return path
    if path.is_dir() and latest(path) is not None:
        return latest(path)
    if path.is_dir() and _STEP.match(path.name):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}: its save never finished)")
    raise CheckpointError(f"{path} is neither a checkpoint (a step-N directory with {MANIFEST}) nor a directory of them")


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / MANIFEST}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("step"), int):
        raise CheckpointError(f"{path / MANIFEST} is not a dlaunch checkpoint manifest")
    return data


def clean_partials(root: Path) -> None:
    """Saves that never finished (a process killed midway) are dropped."""
    if root.is_dir():
        for stale in root.glob(".step-*.partial"):
            shutil.rmtree(stale, ignore_errors=True)


def commit(partial: Path, manifest: dict[str, Any], keep: int) -> Path:
    """Rank 0, once every rank's files are written: manifest, rename, ``latest``, retention."""
    _write_synced(partial / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    final = step_dir(partial.parent, manifest["step"])
    if final.exists():  # the same step saved again (a run re-done from an older checkpoint)
        shutil.rmtree(final)
    os.replace(partial, final)
    marker = partial.parent / (LATEST + ".tmp")
    _write_synced(marker, final.name + "\n")
    os.replace(marker, partial.parent / LATEST)
    _fsync_dir(partial.parent)
    prune(partial.parent, keep, protect=final)
    return final


def prune(root: Path, keep: int, protect: Path) -> None:
    """Keep the ``keep`` newest complete checkpoints (and always ``protect``)."""
    for old in complete_steps(root)[:-keep]:
        if old != protect:
            shutil.rmtree(old, ignore_errors=True)


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
