"""Objects of the user's in a checkpoint: anything with ``state_dict()`` and ``load_state_dict()``.

A script passes them to ``ScriptCheckpoints.save/restore(objects=...)``, a recipe returns them in
``Parts(objects=...)``: an LR scheduler of its own, a GradScaler, an EMA copy, a second optimizer, a stateful
sampler. Each rank saves its own, whole: one blob per object (``torch.save`` of its state dict) under
``objects.rankR.NAME``, checked at the save to load with ``weights_only=True``; a rank whose blob is rank 0's
byte for byte saves only a mark, ``objects.rankR.NAME.rank0`` (``packed``), and a restore follows it. A restore therefore takes the state
as saved, whatever a fresh object's ``state_dict()`` lacks (a second optimizer has no moments before its first
step), and a state that would need code to load is refused when it is saved, not days later when it is needed.
"""

from __future__ import annotations

import collections
import hashlib
import io
import logging
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("dlaunch")
KEY = "objects"


def named(objects: dict[str, Any] | None) -> dict[str, Any]:
    """``objects``, each checked to have ``state_dict`` and ``load_state_dict``, under a name without dots."""
    for name, obj in (objects or {}).items():
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"objects: name {name!r} must be a non-empty string without dots")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"objects[{name!r}]: a {type(obj).__name__} has no state_dict() and load_state_dict()")
    return dict(objects or {})


def checked(objects: dict[str, Any], strategy: Any, rank: int, saving: bool) -> dict[str, Any]:
    """A recipe's ``Parts.objects``, refused before the first step where a checkpoint could not hold them: a strategy
    that saves its variables itself (parameter servers, on their ps tasks), or a state that needs code to load."""
    from launcher.distribute.extended import StrategyExtended

    if objects and strategy is not None and type(strategy).save_checkpoint is not StrategyExtended.save_checkpoint:
        raise TypeError(f"Parts.objects ({', '.join(sorted(objects))}): this strategy saves its variables itself, "
                        "where the recipe's objects cannot go; keep that state in the model (a buffer) instead")
    if saving:
        packed(objects, rank)
    return objects


def packed(objects: dict[str, Any], rank: int, share: bool = False) -> dict[str, Any]:
    """This rank's part of a checkpoint's tensors: each object's state, whole, as a blob (none: ``{}``).

    ``share`` (a save, on every rank of the job at once): the ranks compare their blobs' digests, and a rank whose
    blob is rank 0's byte for byte (an EMA of DDP's replicated weights) saves a mark (``NAME.rank0``) in its place,
    so that a checkpoint holds one copy and not one per rank. Tensors are saved from the CPU, so that copies on
    ``cuda:0`` and ``cuda:1`` compare equal. A rank whose state cannot be saved says so to the others in the same
    exchange, so that every rank stops with the cause instead of waiting for the one that left."""
    blobs, failure = {}, None
    try:
        blobs = {name: _blob(name, obj) for name, obj in objects.items()}
    except TypeError as exc:
        if not share:
            raise
        failure = exc
    if share and _world() > 1:
        digests = {name: hashlib.sha256(blob).hexdigest() for name, blob in blobs.items()}
        every: list[Any] = [None] * _world()
        dist.all_gather_object(every, str(failure) if failure else digests)
        failed = next((r for r, d in enumerate(every) if isinstance(d, str)), None)
        if failure is not None or failed is not None:
            raise failure or TypeError(f"rank {failed} could not save its objects: {every[failed]}")
        if rank != 0:
            blobs = {name: ({"rank0": b""} if every[0].get(name) == digest else blobs[name])
                     for name, digest in digests.items()}
    elif failure is not None:
        raise failure
    return {KEY: {f"rank{rank}": blobs}} if blobs else {}


def _blob(name: str, obj: Any) -> bytes:
    """``obj``'s state saved with ``torch.save``, its tensors moved to the CPU; checked to load with weights_only."""
    buffer = io.BytesIO()
    torch.save(_on_cpu(obj.state_dict()), buffer)
    try:
        state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        lines = str(exc).splitlines()
        why = next((line.strip() for line in lines if "Unsupported global" in line), lines[0] if lines else "")
        raise TypeError(f"objects[{name!r}]: its state_dict() holds more than tensors and plain data, so a "
                        f"restore could not load it without running code ({why}); save that state otherwise") from None
    if _has_meta(state):
        raise TypeError(f"objects[{name!r}]: its state holds tensors on the meta device, which hold no values (an "
                        "object build() made under fsdp's strategy.init_from=rank0 on a rank other than 0)")
    return buffer.getvalue()


def _on_cpu(state: Any) -> Any:
    """``state`` with its tensors on the CPU (where torch.save copies them anyway), in plain dicts, lists, tuples."""
    if isinstance(state, torch.Tensor):
        return state if state.is_meta else state.detach().cpu()
    if type(state) in (dict, collections.OrderedDict, list, tuple):
        items = state.items() if isinstance(state, dict) else state
        return type(state)((k, _on_cpu(v)) for k, v in items) if isinstance(state, dict) else type(state)(map(_on_cpu, items))
    return state


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _has_meta(state: Any) -> bool:
    if isinstance(state, torch.Tensor):
        return state.is_meta
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return any(_has_meta(v) for v in values)


def template(path: Path, objects: dict[str, Any], rank: int) -> dict[str, Any]:
    """What to load for ``objects`` from the checkpoint at ``path``: this rank's own saved state, or rank 0's where
    the saving run had fewer ranks. An object the checkpoint has no state for keeps its own (a warning says so)."""
    if not objects:
        return {}
    from launcher.checkpoint.safe import SafeReader

    world = _world()
    saved: dict[str, dict[str, str]] = {}  # "rankR" -> {name: the rank whose blob holds its state}
    for key in SafeReader(str(path)).read_metadata().state_dict_metadata:
        if key.startswith(f"{KEY}."):
            _, owner, name, *same = key.split(".")
            saved.setdefault(owner, {})[name] = same[0] if same else owner
    source = f"rank{rank}" if f"rank{rank}" in saved else "rank0"
    missing = sorted(set(objects) - set(saved.get(source, {})))
    then, names = len(saved), ", ".join(sorted(objects))
    if rank == 0 and missing:
        log.warning("%s has no saved state for objects %s (it has: %s): they keep the state they were built with",
                    path, ", ".join(missing), ", ".join(sorted(saved.get(source, {}))) or "none")
    if 0 < then < world and rank == then:
        log.warning("objects %s: restored from rank 0's saved state on %s, which the saving run (%d rank(s)) did "
                    "not have", names, _ranks(then, world - 1), then)
    if then > world and rank == 0:
        log.warning("objects %s: the saved state of %s is not restored (this run has %d rank(s))",
                    names, _ranks(world, then - 1), world)
    found: dict[str, dict[str, bytes]] = {}
    for name in objects:
        if name not in missing:
            found.setdefault(saved[source][name], {})[name] = b""
    return {KEY: found} if found else {}


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def restore(loaded: dict[str, Any], objects: dict[str, Any]) -> None:
    """Each object's saved state, from what ``template`` had loaded (onto the CPU: ``load_state_dict`` places it)."""
    for blobs in loaded.get(KEY, {}).values():
        for name, blob in blobs.items():
            state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
            if state:  # a disabled GradScaler has no state, and refuses an empty one
                objects[name].load_state_dict(state)


def read(path: str | Path, name: str, rank: int = 0) -> dict[str, Any]:
    """The saved state of object ``name`` on ``rank``, as its ``state_dict()`` returned it, in one process, on CPU:
    ``AveragedModel(model).load_state_dict(read_object(step_dir, "ema"))``."""
    from launcher.checkpoint import _load
    from launcher.checkpoint.errors import CheckpointError
    from launcher.checkpoint.safe import SafeReader

    key = f"{KEY}.rank{rank}.{name}"
    found = [k for k in SafeReader(str(path)).read_metadata().state_dict_metadata if k.startswith(f"{KEY}.")]
    if f"{key}.rank0" in found:  # the same as rank 0's, which the checkpoint holds once
        return read(path, name, 0)
    if key not in found:
        raise CheckpointError(f"{path} has no object {name!r} of rank {rank} (it has: {', '.join(sorted(found)) or 'none'})")
    tensors = {KEY: {f"rank{rank}": {name: b""}}}
    _load(tensors, Path(path))
    return torch.load(io.BytesIO(tensors[KEY][f"rank{rank}"][name]), weights_only=True, map_location="cpu")
