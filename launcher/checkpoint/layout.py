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
import time
from pathlib import Path
from typing import Any

from launcher.checkpoint.errors import CheckpointError

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
    """The checkpoint ``latest`` names (a ``step-N`` beside it, nothing else); without one, the newest complete."""
    try:
        name = (root / LATEST).read_text().strip()
        if _STEP.match(name) and is_complete(root / name):
            return root / name
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
    newest = latest(path) if path.is_dir() else None
    if newest is not None:
        return newest
    if path.is_dir() and _STEP.match(path.name):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}: its save never finished)")
    raise CheckpointError(f"{path} is neither a checkpoint (a step-N directory with {MANIFEST}) nor a directory of them")


# The manifest's keys that resuming reads, and their JSON types.
_MANIFEST_KEYS = {"format": int, "step": int, "data_position": dict, "world_size": int, "num_replicas": int, "strategy": str,
                  "cluster": str, "global_batch_size": int, "per_replica_batch_size": int, "input": dict, "recipe": dict}


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / MANIFEST}: {exc}") from None
    bad = [k for k, kind in _MANIFEST_KEYS.items() if not isinstance(data, dict) or not isinstance(data.get(k), kind)]
    if bad:
        raise CheckpointError(f"{path / MANIFEST} is not a dlaunch checkpoint manifest (missing or mistyped: {', '.join(bad)})")
    return data


def clean_partials(root: Path) -> None:
    """Saves that never finished (a process killed midway) are dropped, and copies a commit was replacing."""
    if root.is_dir():
        for stale in [*root.glob(".step-*.partial"), *root.glob(".step-*.replaced")]:
            shutil.rmtree(stale, ignore_errors=True)


def commit(partial: Path, manifest: dict[str, Any], keep: int) -> Path:
    """Rank 0, once every rank's files are written: manifest, rename, ``latest``, retention."""
    _write_synced(partial / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    final = step_dir(partial.parent, manifest["step"])
    replaced = final.with_name(f".{final.name}.replaced")
    if final.exists():  # the same step saved again: move the old copy aside in one rename, drop it last
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(partial, final)
    marker = partial.parent / (LATEST + ".tmp")
    _write_synced(marker, final.name + "\n")
    os.replace(marker, partial.parent / LATEST)
    _fsync_dir(partial.parent)
    shutil.rmtree(replaced, ignore_errors=True)
    prune(partial.parent, keep, protect=final)
    return final


def set_aside_after(root: Path, step: int) -> list[Path]:
    """Complete checkpoints later than ``step`` belong to a timeline this run replaces: rename them out of the way.

    They stay on disk (``.superseded-step-N.<time>``), but neither resume nor retention sees them.
    """
    moved = []
    stamp = int(time.time())
    for path in complete_steps(root):
        if int(_STEP.match(path.name).group(1)) > step:
            target = root / f".superseded-{path.name}.{stamp}"
            os.replace(path, target)
            moved.append(target)
    return moved


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
