"""A script's checkpoints, made as a recipe's are: atomic, verified, pruned, and loaded without unpickling code.

    from launcher.checkpoint.scripts import ScriptCheckpoints

    ckpt = ScriptCheckpoints(keep=3)              # $DLAUNCH_RUN_DIR/checkpoints (plain python: ./checkpoints)
    start = ckpt.restore(model, optimizer, objects={"schedule": schedule})  # the newest intact step (0: none)
    for step in range(start + 1, steps + 1):
        ...
        if step % 100 == 0:                       # collective: every rank writes its own part
            ckpt.save(step, model, optimizer, objects={"schedule": schedule})

A save holds the model and the optimizer (through torch's ``get_state_dict``: a DDP module, an FSDP2 one, DTensor
layers and mirrored copies alike), the step, every rank's RNG states, the script's own tensors (``extra``), and
the ``state_dict()`` of each of its ``objects`` (an LR scheduler, a GradScaler, another optimizer, a stateful data
loader: anything with ``state_dict`` and ``load_state_dict`` whose state is tensors and plain data), each rank's
own, whole, as a blob that loads with ``weights_only=True``.
It is written with torch.distributed.checkpoint into ``.step-N.partial/``, each rank's files read back by that
rank, and renamed to ``step-N`` once ``manifest.json`` lists every file's size and sha256
(``launcher/checkpoint/layout.py``). ``restore`` takes the newest intact step (rank 0 checks the digests, the
others the sizes of the one it chose) and passes over a damaged one with a warning. ``dlaunch resume RUN_DIR``
runs the script again with its arguments; its ``restore`` goes on from there.
"""

from __future__ import annotations

import io
import logging
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from launcher.checkpoint import _distributed, _load, _saved_keys, layout, skipped_line, state, write_shards
from launcher.checkpoint.errors import CheckpointError
from launcher.cluster.env import script_run_dir
from launcher.runtime import outputs

log = logging.getLogger("dlaunch")
KIND = "script"  # manifest.json's "kind": a script's checkpoint, whose manifest has no recipe or data position


class ScriptCheckpoints:
    """``save`` and ``restore`` for a script's own loop; both are collective (every rank calls them)."""

    def __init__(self, directory: str | Path | None = None, keep: int = 3):
        run_dir = script_run_dir()  # None under plain python: ./checkpoints
        self.root = Path(directory) if directory is not None else (run_dir or Path.cwd()) / "checkpoints"
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.keep = keep

    @property
    def rank(self) -> int:
        return dist.get_rank() if _distributed() else 0

    def save(self, step: int, model: torch.nn.Module, optimizer: Any = None,
             extra: dict[str, torch.Tensor] | None = None, objects: dict[str, Any] | None = None) -> Path:
        """Save ``step``; returns ``step-N``'s path once it is complete (on every rank)."""
        started, partial = time.perf_counter(), layout.partial_dir(self.root, step)
        own = _packed(_named(objects))  # before any rank writes: a state that could not be restored is refused here
        if self.rank == 0:  # a save of this step that a killed process left half written
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()
        partial.mkdir(parents=True, exist_ok=True)
        tensors = {**_model_state(model, optimizer), "progress": state.progress(step, 0, 0),
                   "rng": {f"rank{self.rank}": state.rng_state()}, **({"extra": extra} if extra else {}),
                   **({"objects": {f"rank{self.rank}": own}} if own else {})}
        read_back = write_shards(partial, step, tensors, self.rank)
        if self.rank == 0:
            world = dist.get_world_size() if _distributed() else 1
            manifest = {"format": 1, "kind": KIND, "step": step, "world_size": world, "files": read_back or {},
                        "torch": torch.__version__, "time": time.time()}
            layout.commit(partial, manifest, self.keep)
            log.info("checkpoint: step %d saved to %s (%.2f s)", step, layout.step_dir(self.root, step),
                     time.perf_counter() - started)
        _barrier()  # no rank goes on (to a restore, or the next save) before the commit
        return layout.step_dir(self.root, step)

    def restore(self, model: torch.nn.Module, optimizer: Any = None, extra: dict[str, torch.Tensor] | None = None,
                objects: dict[str, Any] | None = None) -> int:
        """Load the newest intact checkpoint into ``model``, ``optimizer``, this rank's RNGs, ``extra`` (tensors
        filled in place) and ``objects`` (``load_state_dict``); return its step, or 0 where there is none."""
        objects = _named(objects)
        chosen = self._agreed_choice()
        if chosen is None:
            return 0
        path = layout.step_dir(self.root, chosen)
        problem = layout.check(path, full=False)
        if problem:  # rank 0 read it whole: this rank's view of it differs (a file system that lags?)
            raise CheckpointError(f"rank {self.rank} cannot use {path}, which rank 0 chose: {problem}; every node must "
                                  "see the same directory: ScriptCheckpoints(directory) on a shared file system")
        tensors: dict[str, Any] = {**_model_state(model, optimizer), "progress": state.progress(0, 0, 0)}
        if "optim" in tensors:
            state.drop_unsaved_settings(tensors["optim"], _saved_keys(path, "optim.param_groups."))
        rng = state.rng_template(_saved_keys(path, f"rng.rank{self.rank}."))
        if rng:
            tensors["rng"] = {f"rank{self.rank}": rng}
        if extra:
            tensors["extra"] = extra
        source = self._objects_source(path, objects)
        if objects:
            tensors["objects"] = {source: {name: b"" for name in objects}}
        _load(tensors, path)
        if optimizer is not None:
            state.load_model_and_optimizer(model, optimizer, tensors)
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(state.unwrap(model), tensors["model"])
        if rng:
            state.set_rng_state(tensors["rng"][f"rank{self.rank}"])
        for name, obj in objects.items():
            saved = torch.load(io.BytesIO(tensors["objects"][source][name]), weights_only=True, map_location="cpu")
            if saved:  # a disabled GradScaler has no state, and refuses an empty one
                obj.load_state_dict(saved)
        step = int(tensors["progress"]["step"])
        if self.rank == 0:
            log.info("restored %s: step %d", path, chosen)
            if script_run_dir() is not None:  # under dlaunch: the run's history counts the resume
                outputs.record_resume(script_run_dir(), step)
        return step

    def _objects_source(self, path: Path, objects: dict[str, Any]) -> str:
        """Whose saved objects this rank restores: its own, or rank 0's where the saving run had fewer ranks (said
        once, as is the state of ranks this run does not have)."""
        saved: dict[str, set[str]] = {}  # "rankR" -> the names of the objects it saved
        for key in _saved_keys(path, "objects.") if objects else ():
            rank, name = key.split(".")[:2]
            saved.setdefault(rank, set()).add(name)
        source = f"rank{self.rank}" if f"rank{self.rank}" in saved else "rank0"
        missing = sorted(set(objects) - saved.get(source, set()))
        if missing:
            has = ", ".join(sorted(saved.get(source, set()))) or "none"
            raise CheckpointError(f"{path} has no saved state for objects {', '.join(missing)} (it has: {has}); "
                                  "restore with the objects that save was given")
        world, then = dist.get_world_size() if _distributed() else 1, len(saved)
        if objects and then < world and self.rank == then:
            log.warning("objects %s: ranks %d-%d were not in the saving run (%d ranks) and take rank 0's saved state",
                        ", ".join(sorted(objects)), then, world - 1, then)
        if objects and then > world and self.rank == 0:
            log.warning("objects %s: the saved state of ranks %d-%d is not restored (this run has %d ranks)",
                        ", ".join(sorted(objects)), world, then - 1, world)
        return source

    def _agreed_choice(self) -> int | None:
        """Rank 0's choice (digests checked), told to every rank; damaged steps passed over are said once."""
        found: list[Any] = [None]
        if self.rank == 0:
            layout.clean_partials(self.root)
            choice = layout.choose(self.root, full=True)
            for path, why in choice.skipped:
                log.warning("%s", skipped_line(path, why))
            found = [None if choice.path is None else layout.step_of(choice.path)]
        if _distributed():
            dist.broadcast_object_list(found, src=0)
        return found[0]


def _packed(objects: dict[str, Any]) -> dict[str, bytes]:
    """Each object's ``state_dict()``, whole, as one blob that loads with ``weights_only=True``: a restore takes the
    state as it was saved, whatever a fresh object's own ``state_dict()`` lacks (a second optimizer's moments)."""
    packed = {}
    for name, obj in objects.items():
        buffer = io.BytesIO()
        torch.save(obj.state_dict(), buffer)
        try:
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        except pickle.UnpicklingError as exc:
            lines = str(exc).splitlines()
            why = next((line.strip() for line in lines if "Unsupported global" in line), lines[0] if lines else "")
            raise TypeError(f"objects[{name!r}]: its state_dict() holds more than tensors and plain data, so a "
                            f"restore could not load it without running code ({why}); save that state otherwise") from None
        packed[name] = buffer.getvalue()
    return packed


def _named(objects: dict[str, Any] | None) -> dict[str, Any]:
    """``objects``, each checked to have ``state_dict`` and ``load_state_dict``, under a name without dots."""
    for name, obj in (objects or {}).items():
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"objects: name {name!r} must be a non-empty string without dots")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"objects[{name!r}]: a {type(obj).__name__} has no state_dict() and load_state_dict()")
    return dict(objects or {})


def _model_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    if optimizer is not None:
        return state.model_and_optimizer(model, optimizer)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {"model": get_model_state_dict(state.unwrap(model))}


def _barrier() -> None:
    if _distributed():
        dist.barrier()
