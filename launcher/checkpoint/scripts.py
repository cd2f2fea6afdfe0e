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

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from launcher.checkpoint import _distributed, _load, _saved_keys, layout, skipped_line, state, write_shards
from launcher.checkpoint import objects as saved_objects
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
        own = saved_objects.packed(saved_objects.named(objects), self.rank, share=True)  # refused before any rank writes
        if self.rank == 0:  # a save of this step that a killed process left half written
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()
        partial.mkdir(parents=True, exist_ok=True)
        tensors = {**_model_state(model, optimizer), "progress": state.progress(step, 0, 0),
                   "rng": {f"rank{self.rank}": state.rng_state()}, **({"extra": extra} if extra else {}),
                   **own}
        read_back = write_shards(partial, step, tensors, self.rank, state.buffer_keys(model))
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
        objects = saved_objects.named(objects)
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
        tensors.update(saved_objects.template(path, objects, self.rank))
        _load(tensors, path)
        if optimizer is not None:
            state.load_model_and_optimizer(model, optimizer, tensors)
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(state.unwrap(model), tensors["model"])
        if rng:
            state.set_rng_state(tensors["rng"][f"rank{self.rank}"])
        saved_objects.restore(tensors, objects)
        step = int(tensors["progress"]["step"])
        if self.rank == 0:
            log.info("restored %s: step %d", path, chosen)
            run_dir = script_run_dir()
            if run_dir is not None:  # under dlaunch: the run's history counts the resume
                outputs.record_resume(run_dir, step)
        return step

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


def _model_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    if optimizer is not None:
        return state.model_and_optimizer(model, optimizer)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {"model": get_model_state_dict(state.unwrap(model))}


def _barrier() -> None:
    if _distributed():
        dist.barrier()
