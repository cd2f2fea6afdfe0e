"""Checkpoints through torch.distributed.checkpoint (DCP), and exact resume.

A checkpoint holds the model, the optimizer, the step, every rank's RNG states
(torch, numpy, python, CUDA) and the data position, so a resumed run continues
mid-epoch with the batches the interrupted one would have seen next. Saves are
atomic (``layout``), loads never unpickle code (``safe``), and the manifest
explains what changed since the save (``manifest``).

    ckpt = Checkpointer(spec, run_dir, rank=0)
    step, position = ckpt.load(path, model, optimizer)     # any world size: DCP reshards
    ckpt.save(step, position, model, optimizer)             # collective: every rank calls it

torch.distributed.checkpoint itself (with DTensor and sympy, half a second of
imports) is imported on the first save or load, not by a run without checkpoints.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from launcher.checkpoint import errors, integrity, layout, manifest, state
from launcher.checkpoint.best import Best
from launcher.checkpoint import objects as saved_objects
from launcher.checkpoint.objects import read as read_object
from launcher.checkpoint.errors import CheckpointError, NoIntactCheckpoint, StopNotSaved, UnsafeCheckpoint, storage_refusal
from launcher.checkpoint.writer import planner, storage_writer
from launcher.cluster.process_group import comm_device
from launcher.config.schema import RunSpec
from launcher.input.position import Position
from launcher.runtime import outputs

__all__ = ["Checkpointer", "CheckpointError", "NoIntactCheckpoint", "UnsafeCheckpoint", "root_of", "select", "find", "read_tensors",
           "read_object"]
log = logging.getLogger("dlaunch")
# What to do about the storage, by the error it gave (any other: "Mend the storage").
_REMEDY = {errno.ENOSPC: "Free space there", errno.EDQUOT: "Free space there (or raise the quota)",
           errno.EACCES: "Make it writable for this user", errno.EPERM: "Make it writable for this user",
           errno.EROFS: "Save to a writable file system (trainer.checkpoint.dir)"}


def root_of(spec: RunSpec, run_dir: Path) -> Path:
    """Where the run's checkpoints live: ``trainer.checkpoint.dir``, else ``RUN_DIR/checkpoints``."""
    return spec.trainer.checkpoint.root(run_dir)


def select(spec: RunSpec, run_dir: Path, restarted: bool = False, full: bool = True) -> layout.Choice:
    """The checkpoint this run resumes from (a path of None: step 0), checked against the spec.

    ``trainer.resume`` decides (in the workers: the checkpoint the launcher verified), except after an elastic
    restart once this command has saved: then its newest checkpoint wins (a restart continues the run, whatever
    it started from). Until then a restart resumes as the first attempt did: the directory may hold another
    timeline's later or damaged steps, or an older run's earlier ones.
    Damaged checkpoints are passed over for the newest intact one (``Choice.skipped``
    says which and why); when every one found is damaged, ``NoIntactCheckpoint``.
    ``full``: verify digests, not only sizes.
    """
    root = root_of(spec, run_dir)
    began = layout.timeline_start(root) if restarted else None
    try:
        choice = layout.choose(root, full) if began is not None else layout.Choice(None)
        if choice.path is None or layout.step_of(choice.path) <= began:  # none of this command's: as at first
            choice = layout.resolve(spec.trainer.resume, root, full)
        if choice.path is None:
            if choice.skipped:
                raise NoIntactCheckpoint(choice.skipped)
            return choice
        saved = layout.read_manifest(choice.path)
        manifest.check_compatible(saved, spec, str(choice.path))
        from launcher.checkpoint.safe import SafeReader

        SafeReader(choice.path).read_metadata()  # refuses a planted pickle before any process starts
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint directory {root}: {exc}") from None
    if saved["step"] > spec.trainer.steps:
        raise CheckpointError(
            f"{choice.path} is at step {saved['step']}, past trainer.steps={spec.trainer.steps}; raise trainer.steps, "
            "or resume from an earlier checkpoint (trainer.resume=PATH), or start afresh (trainer.resume=never)"
        )
    return choice


def find(spec: RunSpec, run_dir: Path, restarted: bool = False, full: bool = False) -> Path | None:
    """``select``'s checkpoint, with one warning line per damaged one passed over.

    Workers call it with sizes-only checks (``full=False``): the launcher verified the digests before starting them.
    """
    choice = select(spec, run_dir, restarted, full)
    for path, why in choice.skipped:
        log.warning("%s", skipped_line(path, why))
    return choice.path


def skipped_line(path: Path, why: str) -> str:
    return f"checkpoint {path} is damaged and was skipped: {why}"


def read_tensors(path: str | Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    """The tensors saved under ``prefix`` (``model``: the module's state dict), in one process, on CPU.

    ``torch.nn.Linear(32, 1).load_state_dict(read_tensors("outputs/.../checkpoints/step-00000200"))``; a ``latest``
    or ``best`` marker reads as the checkpoint it names.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from launcher.checkpoint.safe import SafeReader

    path = layout.marked(Path(path))
    reader = SafeReader(str(path))
    metadata = reader.read_metadata()
    wanted = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix + ".") and isinstance(meta, TensorStorageMetadata)
    }
    if not wanted:
        raise CheckpointError(f"{path} holds no tensors under {prefix!r}")
    _load(wanted, Path(path))
    return {key[len(prefix) + 1 :]: value for key, value in wanted.items()}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class Checkpointer:
    """One worker's side of saving and loading; ``save`` and ``load`` are collective."""

    def __init__(self, spec: RunSpec, run_dir: Path, rank: int, strategy: Any = None, objects: dict[str, Any] | None = None):
        """``strategy``: the ``StrategyExtended`` whose hooks may save and load the variables themselves.
        ``objects``: the recipe's own (``Parts.objects``), saved and restored with the rest."""
        self.spec, self.rank = spec, rank
        self.strategy = strategy
        self.objects = saved_objects.checked(objects or {}, strategy, rank, spec.trainer.checkpoint.every_steps > 0)
        self.root, self.run_dir = root_of(spec, run_dir), run_dir
        self.every = spec.trainer.checkpoint.every_steps
        self.best = Best(spec.trainer.checkpoint.best, rank)  # the best evaluation so far, in every manifest
        self._saved: tuple[int, Path] | None = None  # the last step saved, and where
        self.loaded_loop: dict[str, torch.Tensor] = {}  # the loop's state (schedule, scaler) from the last load
        self.unsaved = ""  # why the last save was not (on_error=warn), until one is

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def due(self, step: int) -> bool:
        return self.enabled and (step % self.every == 0 or step == self.spec.trainer.steps)

    def start(self, first_step: int) -> None:
        """Before the first save: rank 0 drops unfinished saves and sets aside later steps of another timeline."""
        if self.rank == 0:
            layout.clean_partials(self.root)
            for moved in layout.set_aside_after(self.root, first_step):
                damaged = layout.check(moved) is not None  # its warning was given when the resume passed it over
                log.log(logging.INFO if damaged else logging.WARNING,
                        "a checkpoint later than this run's start (step %d) was moved aside: %s", first_step, moved)
            layout.begin_timeline(self.root, first_step)  # a restart may now resume from this command's newest
        if _distributed():
            dist.barrier()
            self._shared_by_every_node()

    def _shared_by_every_node(self) -> None:
        """Several nodes save into one directory: one on each node's own disk would keep a part of every checkpoint
        on each (and rank 0 would verify the part it sees), so no resume would find one whole. Every rank must
        read the word rank 0 writes there; all raise together where one cannot."""
        if self.spec.cluster.nodes <= 1:
            return
        word = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], device=comm_device())  # not torch's RNG
        dist.all_reduce(word)  # rank 0's word, everywhere
        marker = self.root / f".shared-{int(word)}"  # a new name each time: no cache can show an older one
        if self.rank == 0:
            with contextlib.suppress(OSError):  # then no rank sees it, and all say so below
                self.root.mkdir(parents=True, exist_ok=True)
                marker.write_text(str(int(word)))
        dist.barrier()
        try:
            seen = marker.read_text() == str(int(word))
        except OSError:
            seen = False
        node = self.rank // max(1, dist.get_world_size() // self.spec.cluster.nodes)
        blind = torch.tensor([0 if seen else node + 1], device=comm_device())
        dist.all_reduce(blind, op=dist.ReduceOp.MAX)  # every rank has read it by now
        if self.rank == 0:
            with contextlib.suppress(OSError):
                marker.unlink(missing_ok=True)
        if int(blind):
            raise CheckpointError(
                f"the checkpoint directory {self.root} is not shared by the nodes: node {int(blind) - 1} does not see "
                "what node 0 writes there, so each node would keep a part of every checkpoint and no resume would find "
                "one whole; give every node the same directory on a shared file system (trainer.checkpoint.dir=...)")

    def save(self, step: int, position: Position, model: Any, optimizer: Any,
             loop: dict[str, torch.Tensor] | None = None, stopping: bool = False) -> Path | None:
        """Save ``step`` (collective); None when the disk refused it and ``trainer.checkpoint.on_error=warn``.

        ``loop``: the training loop's own tensors (its schedule's position, fp16's scale). ``stopping``: the save
        of a stop signal, after which the run ends.
        """
        if self._saved and self._saved[0] == step:  # e.g. a stop signal right after a scheduled save
            if stopping and self._saved[1] is None and self.rank == 0:  # whose commit failed (on_error=warn)
                outputs.record_unsaved_stop(self.run_dir, step, self.unsaved)
            return self._saved[1]
        started = time.perf_counter()
        partial = layout.partial_dir(self.root, step)
        final = layout.step_dir(self.root, step)
        written = False  # every rank's files are (DCP's save returned): what follows is rank 0's alone
        try:
            partial.mkdir(parents=True, exist_ok=True)
            progress = (step, position.epoch, position.offset)
            read_back = None
            if self.strategy is None or not self.strategy.save_checkpoint(model, partial, progress):
                read_back = self._save_here(partial, step, position, model, optimizer, loop or {})
            written = True
            if self.rank == 0:  # DCP returned: every rank's files are written
                saved = {**manifest.build(self.spec, step, position), "files": read_back or {}, **self.best.record()}
                layout.commit(partial, saved, self.spec.trainer.checkpoint.keep)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            refused = storage_refusal(exc, self.root)
            if refused is None:  # only a storage failure is this method's to report
                raise
            self.best.unsaved(step)
            if written:  # rank 0's commit alone failed: the others hold the step saved, and no rank saves it again
                self._saved = (step, None)  # (a stop after it would run DCP's collective save on rank 0 alone)
            return self._not_saved(step, partial, refused, stopping)
        self.unsaved = ""
        if self.rank == 0:
            best = f"; the best {self.best.said()}" if self.best.step == step else ""
            log.info("checkpoint: step %d saved to %s (%.2f s)%s", step, final, time.perf_counter() - started, best)
        self._saved = (step, final)
        return final

    def _not_saved(self, step: int, partial: Path, cause: OSError, stopping: bool = False) -> None:
        """The storage refused the save (disk full, I/O error): drop what was half written, then end the run or warn."""
        if self.rank == 0:  # DCP reports a failed write on every rank once all of them are done writing
            shutil.rmtree(partial, ignore_errors=True)
        previous = layout.latest(self.root)
        kept = f"{previous.name} is intact and `latest` still names it" if previous else "no earlier checkpoint exists"
        what = f"{cause.strerror or cause}" + (f" ({errno.errorcode.get(cause.errno, cause.errno)})" if cause.errno else "")
        where = f" writing {Path(cause.filename).name}" if cause.filename else ""
        message = f"the checkpoint of step {step} was not saved: {what}{where} in {self.root}; {kept}"
        if self.spec.trainer.checkpoint.on_error == "warn":
            self.unsaved = message
            if self.rank == 0 and stopping:  # the stop's summary says so: not the earlier checkpoint as if it were this
                outputs.record_unsaved_stop(self.run_dir, step, message)
            elif self.rank == 0:
                log.warning("%s; training continues (trainer.checkpoint.on_error=warn)", message)
            return None
        remedy = _REMEDY.get(cause.errno, "Mend the storage")
        if stopping:  # trainer.checkpoint.on_error=error asked for a refused save to end the run as failed, a stop's too
            again = f"continues from {previous.name}: the steps after it are trained again" if previous else "starts afresh"
            raise StopNotSaved(f"{message}. It was the checkpoint of a stop signal: the run stopped without it, and "
                                  "ends as failed since trainer.checkpoint.on_error=error makes a refused save an error. "
                                  f"{remedy} and run the same command again (trainer.resume=auto {again}); with "
                                  "trainer.checkpoint.on_error=warn such a stop ends as a stop, its summary naming the "
                                  "lost save")
        raise CheckpointError(f"{message}. {remedy} and run the same command again (trainer.resume=auto continues from "
                              "it), or set trainer.checkpoint.on_error=warn to train on without this save")

    def _save_here(self, partial: Path, step: int, position: Position, model: Any, optimizer: Any,
                   loop: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        tensors = {
            **state.model_and_optimizer(model, optimizer),
            "progress": state.progress(step, position.epoch, position.offset),
            "rng": {f"rank{self.rank}": state.rng_state()},
            **({"loop": loop} if loop else {}),
            **saved_objects.packed(self.objects, self.rank, share=True),
        }
        return write_shards(partial, step, tensors, self.rank, state.buffer_keys(model))

    def load(self, path: Path, model: Any, optimizer: Any, loop: dict[str, torch.Tensor] | None = None) -> tuple[int, Position]:
        """Restore model, optimizer and this rank's RNG from ``path``; return (step, data position).

        ``loop``: templates of the loop's tensors; those the checkpoint holds end up in ``loaded_loop``.
        """
        saved = layout.read_manifest(path)
        manifest.check_compatible(saved, self.spec, str(path))
        self.best.restore(saved)
        kept = None if self.strategy is None else self.strategy.load_checkpoint(model, path)
        if kept is not None:  # the strategy keeps its variables itself (parameter servers)
            step, epoch, offset = kept
            self._saved = (step, path)
            return step, Position(epoch, offset)
        tensors: dict[str, Any] = {**state.model_and_optimizer(model, optimizer), "progress": state.progress(0, 0, 0)}
        state.drop_unsaved_settings(tensors["optim"], _saved_keys(path, "optim.param_groups."))
        rng = state.rng_template(_saved_keys(path, f"rng.rank{self.rank}."))
        if rng:
            tensors["rng"] = {f"rank{self.rank}": rng}
        saved_loop = _saved_keys(path, "loop.") if loop else set()
        if saved_loop:
            tensors["loop"] = {k: v for k, v in loop.items() if k in saved_loop}
        tensors.update(saved_objects.template(path, self.objects, self.rank))
        _load(tensors, path)
        saved_objects.restore(tensors, self.objects)
        self.loaded_loop = tensors.get("loop", {})
        state.load_model_and_optimizer(model, optimizer, tensors)
        if rng:
            state.set_rng_state(tensors["rng"][f"rank{self.rank}"])
        else:
            log.info("rank %d has no saved RNG state (the checkpoint has %d rank(s)); it keeps its seeded RNG",
                     self.rank, saved["world_size"])
        p = tensors["progress"]
        self._saved = (int(p["step"]), path)
        return int(p["step"]), Position(int(p["epoch"]), int(p["offset"]))


def agree(path: Path | None, step: int) -> None:
    """Every rank must resume from the same step: ranks that see different checkpoints cannot train together."""
    low, high = extremes(step)
    if low != high:
        raise CheckpointError(
            f"the ranks found different checkpoints to resume from (steps {low} to {high}; this rank: "
            f"{path or 'none'}); every node must see the same trainer.checkpoint.dir (a shared file system)"
        )


def extremes(value: int) -> tuple[int, int]:
    """Collective: the lowest and the highest of every rank's ``value`` (this rank's alone without a process group)."""
    if not _distributed():
        return value, value
    mine = torch.tensor([value, -value], device=comm_device())  # nccl's default group takes no CPU tensor
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return -int(mine[1]), int(mine[0])


def write_shards(partial: Path, step: int, tensors: dict[str, Any], rank: int,
                 pinned: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """Collective: every rank's part of ``tensors`` into ``partial`` (DCP), then read back by the rank that wrote
    it; the files' records on rank 0 (None elsewhere, and in one process: rank 0's commit reads them all).
    ``pinned``: keys written from rank 0's copy (a model's buffers, ``writer.planner``)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": it is one
        dcp.save(tensors, storage_writer=storage_writer(partial, step), planner=planner(pinned), no_dist=not _distributed())
    return _read_back(partial, rank)


def _read_back(partial: Path, rank: int) -> dict[str, Any] | None:
    """Collective after a DCP save: each rank's digests of its own files, gathered on rank 0 (None elsewhere)."""
    if not _distributed() or dist.get_world_size() == 1:
        return None
    try:
        mine = integrity.own_files(partial, rank)
    except OSError:  # rank 0 reads them instead, or says what it cannot read
        mine = {}
    found: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, found, dst=0)
    return {name: rec for records in found for name, rec in records.items()} if found is not None else None


def _saved_keys(path: Path, prefix: str) -> set[str]:
    """The names (after ``prefix``) of the tensors the checkpoint holds under ``prefix``."""
    from launcher.checkpoint.safe import saved_entries

    return set(saved_entries(path, prefix))


def _load(tensors: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from launcher.checkpoint.safe import SafeLoadPlanner, SafeReader

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=not _distributed())
    except CheckpointError:
        raise
    except (CheckpointException, Exception) as exc:  # DCP's own errors (per rank), reworded with the path
        from launcher.runtime.preemption import Preempted

        cause = errors.cause_of(exc)
        if isinstance(cause, (KeyboardInterrupt, Preempted)):  # a stop signal during the load: not the checkpoint's fault
            raise cause from None
        raise errors.explain_load(exc, path, set(tensors.get("model", {})), _model_keys(path)) from None


def _model_keys(path: Path) -> set[str]:
    """The checkpoint's model state names (none where its metadata cannot be read)."""
    try:
        return _saved_keys(path, "model.")
    except Exception:  # noqa: BLE001 - the load's own error is what to say
        return set()
