"""A checkpoint directory: complete steps, the ``latest`` marker, partial saves.

    CHECKPOINTS/
      latest                    "step-00000120": moves only after every rank wrote that step
      best                      "step-00000100": the best evaluation's (trainer.checkpoint.best), kept whatever its age
      step-00000100/            DCP files (.metadata, __N_0.distcp) + manifest.json
      step-00000120/
      .step-00000140.partial/   a save in progress (or one killed midway): never read

A save writes into ``.step-N.partial``, rank 0 adds ``manifest.json`` (with each
file's size and sha256, ``integrity``) once DCP reports every rank's files
written, renames the directory to ``step-N`` (one atomic rename) and only then
rewrites ``latest`` (write + ``os.replace``). So a process killed at any moment
leaves ``latest`` naming a complete checkpoint.

Resuming takes the newest ``step-N`` (the one ``latest`` names, unless writing the
marker itself failed after the commit); one that fails its check (``choose``) is
passed over for the next newest, and the caller is told which and why.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from launcher.checkpoint import integrity
from launcher.checkpoint.errors import CheckpointError

log = logging.getLogger("dlaunch")
LATEST = "latest"
BEST = "best"
MANIFEST = "manifest.json"
TIMELINE = ".timeline"  # the step this command's checkpoints began after (Checkpointer.start); cleared as a command starts
_STEP = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def step_of(path: Path) -> int:
    """The step a checkpoint directory (``step-N``) was saved after."""
    return int(_STEP.match(path.name).group(1))


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
    """The newest complete checkpoint: the one ``latest`` names, unless writing that marker failed after the step's
    commit (``choose`` takes the same one, intact)."""
    steps = complete_steps(root)
    return steps[-1] if steps else None


def newest(spec: Any, run_dir: Path) -> Path | None:
    """The newest complete checkpoint a run in ``run_dir`` goes on from (None: checkpoints off, or none complete). A
    script's: ScriptCheckpoints' default directory (a directory of the script's own choosing is not known here)."""
    if spec.script is not None:
        return latest(run_dir / "checkpoints")
    return latest(spec.trainer.checkpoint.root(run_dir)) if spec.trainer.checkpoint.every_steps else None


@dataclasses.dataclass(frozen=True)
class Choice:
    """The checkpoint to resume from (None: none intact, or none at all), and those passed over with the reason."""

    path: Path | None
    skipped: tuple[tuple[Path, str], ...] = ()


def check(path: Path, full: bool = True) -> str | None:
    """Why the checkpoint at ``path`` cannot be used (None: it is intact). ``full``: digests, not only sizes."""
    if not path.is_dir():
        return "it does not exist"
    if not (path / MANIFEST).is_file():
        return f"{MANIFEST} is missing"
    try:
        saved = read_manifest(path)
    except CheckpointError as exc:
        return str(exc).replace(f"{path / MANIFEST}", MANIFEST)
    step = _STEP.match(path.name)
    if step and int(step.group(1)) != saved["step"]:  # the plan and the workers would disagree on where it resumes
        return (f"{MANIFEST} says step {saved['step']}, but its directory is {path.name} (renamed, or its manifest "
                "edited? a checkpoint's directory is step-N for its step N)")
    if "files" not in saved:
        if saved.get("kind") == "script" or "lr_decay" in saved:  # written since dlaunch lists every file: cut
            return f"{MANIFEST} lists no files (a save always does)"
        # saved before dlaunch recorded checksums: the DCP metadata at least must be there
        return None if (path / ".metadata").is_file() else ".metadata is missing"
    if ".metadata" not in saved["files"]:  # every save lists DCP's metadata: this list was edited or cut short
        return f"{MANIFEST} lists no .metadata among its files (a save always does)"
    return integrity.damage(path, saved["files"], full)


def choose(root: Path, full: bool = True) -> Choice:
    """The newest intact ``step-N`` under ``root``.

    ``latest`` names it unless the marker's own write failed after the step's commit (a disk that filled up just
    then): the committed step still wins. A ``latest`` naming a step that is gone, or garbled, is reported as skipped.
    """
    if not root.is_dir():
        return Choice(None)
    put_back_set_aside(root)
    named = _latest_name(root)
    found = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()), reverse=True)
    candidates = [p for _, p in found]
    if named and root / named not in candidates:
        candidates.insert(0, root / named)
    garbled = _garbled_latest(root)
    skipped = [(root / LATEST, f"{garbled}: the step directories decide")] if garbled else []
    for path in candidates:
        why = check(path, full)
        if why is None:
            return Choice(path, tuple(skipped))
        skipped.append((path, f"{LATEST} names it, but {why}" if path.name == named else why))
    return Choice(None, tuple(skipped))


def newer_steps(path: Path) -> list[Path]:
    """The ``step-N`` directories beside ``path`` with a later step: those a resume from ``path`` passed over."""
    m = _STEP.match(path.name)
    if not m or not path.parent.is_dir():
        return []
    found = [(int(n.group(1)), p) for p in path.parent.iterdir() if (n := _STEP.match(p.name)) and p.is_dir()]
    return [p for step, p in sorted(found) if step > int(m.group(1))]


def _latest_name(root: Path) -> str | None:
    return _marker_name(root, LATEST)


def _marker_name(root: Path, marker: str) -> str | None:
    try:
        name = (root / marker).read_text().strip()
    except (OSError, UnicodeDecodeError):  # unreadable, or garbled (a flipped bit): the step directories decide
        return None
    return name if _STEP.match(name) else None


def _garbled_latest(root: Path) -> str | None:
    """Why ``latest`` names no step (a flipped bit, a torn write by some other tool); None: it does, or is not there."""
    try:
        raw = (root / LATEST).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"the marker cannot be read ({exc.strerror or exc})"
    if _latest_name(root) is not None:
        return None
    return f"the marker is garbled (it holds {raw[:40]!r}{'...' if len(raw) > 40 else ''}, not a step-N name)"


def resolve(resume: str, root: Path, full: bool = True) -> Choice:
    """The checkpoint ``trainer.resume`` (auto | never | PATH) selects; a path of None: start afresh.

    A PATH naming one checkpoint is that one or an error; a directory of them is searched as ``auto`` searches.
    """
    if resume == "never":
        return Choice(None)
    if resume == "auto":
        return choose(root, full)
    path = marked(Path(resume))  # CHECKPOINTS/best or CHECKPOINTS/latest: the step it names
    if (path / MANIFEST).is_file() or (_STEP.match(path.name) and path.is_dir()):
        why = check(path, full)
        if why is not None:
            raise CheckpointError(f"{path} cannot be resumed from: {why}")
        return Choice(path)
    choice = choose(path, full) if path.is_dir() else Choice(None)
    if choice.path is None and not choice.skipped:
        raise CheckpointError(f"{path} is neither a checkpoint (a step-N directory with {MANIFEST}) nor a directory of them")
    return choice


# The manifest's keys that resuming reads, and their JSON types.
_MANIFEST_KEYS = {"format": int, "step": int, "data_position": dict, "world_size": int, "num_replicas": int, "strategy": str,
                  "cluster": str, "global_batch_size": int, "per_replica_batch_size": int, "input": dict, "recipe": dict}
_SCRIPT_KEYS = {"format": int, "step": int, "world_size": int}  # a script's own (launcher/checkpoint/scripts.py)


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / MANIFEST}: {exc}") from None
    keys = _SCRIPT_KEYS if isinstance(data, dict) and data.get("kind") == "script" else _MANIFEST_KEYS
    bad = [k for k, kind in keys.items() if not isinstance(data, dict) or not isinstance(data.get(k), kind)]
    if "files" in data and not isinstance(data["files"], dict):
        bad.append("files")
    if bad:
        raise CheckpointError(f"{path / MANIFEST} is not a dlaunch checkpoint manifest (missing or mistyped: {', '.join(bad)})")
    return data


def clean_partials(root: Path) -> None:
    """Saves that never finished (a process killed midway) are dropped, and copies a commit was replacing; a copy
    that a commit moved aside and died before the new one took its name is put back first."""
    if not root.is_dir():
        return
    put_back_set_aside(root)
    for stale in [*root.glob(".step-*.partial"), *root.glob(".step-*.replaced")]:
        shutil.rmtree(stale, ignore_errors=True)


def put_back_set_aside(root: Path) -> None:
    """A step a commit moved aside to save it again, where the process died before the new copy took its name."""
    for aside in root.glob(".step-*.replaced"):
        final = root / aside.name[1:].removesuffix(".replaced")
        if not final.exists() and is_complete(aside):
            try:
                os.replace(aside, final)
            except OSError:  # another rank put it back first, or the store is read-only: resume from what is there
                pass


def commit(partial: Path, manifest: dict[str, Any], keep: int) -> Path:
    """Rank 0, once every rank's files are written: manifest (with the files' digests: those of ``manifest``'s
    ``files`` the other ranks read back, the rest read here), rename, ``latest``, retention."""
    manifest = {**manifest, "files": integrity.fingerprint(partial, manifest.get("files"))}
    _write_synced(partial / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _fsync_dir(partial)  # its entries are on disk before the rename says the step is complete
    final = step_dir(partial.parent, manifest["step"])
    replaced = final.with_name(f".{final.name}.replaced")
    if final.exists():  # the same step saved again: move the old copy aside in one rename, drop it last
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(partial, final)
    best = best_of(final.parent, manifest)
    markers = {LATEST: final, **({BEST: best} if best is not None and best.is_dir() else {})}
    try:
        for marker, step in markers.items():
            _point(step, marker)
    except OSError as exc:  # the step is saved; resuming takes the newest intact step, named by the marker or not
        for marker in markers:
            (final.parent / (marker + ".tmp")).unlink(missing_ok=True)
        log.warning("checkpoint %s is saved, but the %s marker could not follow it (%s): a resume takes the newest "
                    "intact step all the same", final.name, " and ".join(markers), exc.strerror or exc)
    shutil.rmtree(replaced, ignore_errors=True)
    prune(partial.parent, keep, protect=(final, best))
    return final


def best_of(root: Path, manifest: dict[str, Any]) -> Path | None:
    """The checkpoint a manifest names as the best as of its step (trainer.checkpoint.best), if it names one."""
    found = manifest.get("best")
    step = found.get("step") if isinstance(found, dict) else None
    return step_dir(root, step) if isinstance(step, int) else None


def marked(path: Path) -> Path:
    """The checkpoint a ``latest`` or ``best`` marker names (``path`` itself where it is no such marker)."""
    if path.name in (LATEST, BEST) and path.is_file():
        name = _marker_name(path.parent, path.name)
        if name and (path.parent / name).is_dir():
            return path.parent / name
    return path


def set_aside_after(root: Path, step: int) -> list[Path]:
    """Checkpoints later than ``step`` belong to a timeline this run replaces: rename them out of the way.

    They stay on disk (``.superseded-step-N.<time>``), but neither resume nor retention sees them; so do
    damaged ones that a resume passed over.
    """
    moved = []
    stamp = int(time.time())
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        m = _STEP.match(path.name)
        if m and path.is_dir() and int(m.group(1)) > step:
            target = root / f".superseded-{path.name}.{stamp}"
            os.replace(path, target)
            moved.append(target)
    start = step_dir(root, step)
    for marker in (LATEST, BEST):
        named = _marker_name(root, marker)
        stale = not (root / named).is_dir() if named else (root / marker).exists()  # a step set aside or deleted; garbled
        if stale:  # name the start (the start's best), or nothing
            target = start if marker == LATEST else _start_best(start)
            if target is not None and target.is_dir():
                _point(target, marker)
            else:
                (root / marker).unlink(missing_ok=True)
    return moved


def _start_best(start: Path) -> Path | None:
    try:
        return best_of(start.parent, read_manifest(start)) if start.is_dir() else None
    except CheckpointError:
        return None


def prune(root: Path, keep: int, protect: tuple[Path | None, ...]) -> None:
    """Keep the ``keep`` newest complete checkpoints (and always those of ``protect``: the new one, the best)."""
    for old in complete_steps(root)[:-keep]:
        if old not in protect:
            shutil.rmtree(old, ignore_errors=True)
            if _marker_name(root, BEST) == old.name:  # a best no longer judged (trainer.checkpoint.best turned off)
                (root / BEST).unlink(missing_ok=True)


def _point(step: Path, marker: str = LATEST) -> None:
    tmp = step.parent / (marker + ".tmp")
    _write_synced(tmp, step.name + "\n")
    os.replace(tmp, step.parent / marker)
    _fsync_dir(step.parent)


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


def begin_timeline(root: Path, step: int) -> None:
    """This command's checkpoints begin after ``step`` (later steps of another timeline are set aside): a restart
    may now resume from the newest one past it. In the checkpoint directory, which every node shares."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TIMELINE}.tmp"
    tmp.write_text(f"{step}\n")
    os.replace(tmp, root / TIMELINE)


def timeline_start(root: Path) -> int | None:
    """The step this command's checkpoints began after; None before they began (or unreadable)."""
    try:
        return int((root / TIMELINE).read_text())
    except (OSError, ValueError):
        return None
