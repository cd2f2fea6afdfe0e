"""Auto-sharding across workers: ``AutoShardPolicy`` and the shard plan it makes.

A *worker* is one input pipeline: one process (``num_input_pipelines`` =
processes). With ``n`` workers, worker ``i`` gets:

* ``FILE``: files ``i, i+n, i+2n, ...`` of the ordered file list; it reads only
  those. Needs at least one file per worker.
* ``DATA``: every file is read; it keeps element ``k`` of the (shuffled) stream
  when ``k % n == i``. Every worker reads everything, so this warns once.
* ``OFF``: no sharding; every worker sees every element, and each global batch
  is split across replicas as usual (worker ``i`` keeps its block of rows).
* ``AUTO``: ``FILE`` when the dataset is file-backed with files >= workers,
  ``DATA`` otherwise.

Each worker batches its share into ``global_batch_size / n`` rows per step, and
splits that across its local replicas. With the same shuffle seed everywhere,
``DATA`` and ``OFF`` see the same global batches as one device does.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import TYPE_CHECKING, Sequence, TypeVar

if TYPE_CHECKING:  # validation and the plan use this module without loading torch
    import torch

log = logging.getLogger("dlaunch")
T = TypeVar("T")


class AutoShardPolicy(enum.Enum):
    """How a distributed dataset is sharded across workers (tf.data's names).

    Example::

        options = InputOptions(auto_shard_policy=AutoShardPolicy.DATA)
        dist = strategy.experimental_distribute_dataset(files.batch(64), options)
    """

    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    OFF = "OFF"

    @classmethod
    def from_any(cls, value: "AutoShardPolicy | str") -> "AutoShardPolicy":
        if isinstance(value, cls):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise ValueError(f"unknown auto_shard_policy {value!r}; allowed: {', '.join(cls.__members__)}") from None


class TooFewFilesError(ValueError):
    """``FILE`` sharding with fewer files than workers."""


def too_few_files(num_files: int, num_workers: int) -> str:
    return (
        f"{num_files} file{'s' if num_files != 1 else ''} for {num_workers} workers: FILE sharding needs at least "
        f"one file per worker; use DATA (every worker reads every file and keeps one element in {num_workers}) "
        "or OFF (no sharding), or write more files"
    )


def resolve_policy(policy: AutoShardPolicy | str, num_files: int | None, num_workers: int) -> AutoShardPolicy:
    """The policy that runs: ``AUTO`` decided, ``FILE`` checked.

    ``num_files`` is None for a dataset that is not read from files.
    """
    policy = AutoShardPolicy.from_any(policy)
    if policy is AutoShardPolicy.AUTO:
        can_file = num_files is not None and num_files >= num_workers
        return AutoShardPolicy.FILE if can_file else AutoShardPolicy.DATA
    if policy is AutoShardPolicy.FILE:
        if num_files is None:
            raise ValueError("AutoShardPolicy.FILE needs a file-backed dataset (launcher.input.files.FileDataset); use DATA or OFF")
        if num_files < num_workers:
            raise TooFewFilesError(too_few_files(num_files, num_workers))
    return policy


_warned_data = False


def refuse_sharded_loader(loader: object, num_workers: int) -> None:
    """A ``DataLoader`` whose sampler is a ``DistributedSampler`` already gives each process its share: split again
    as global batches, each rank would train on ``1/num_workers`` of that share, with no error (the usual half-way
    move from a torchrun script). Raised, naming both ways out."""
    from torch.utils.data.distributed import DistributedSampler

    samplers = (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None))
    found = next((s for s in samplers if isinstance(s, DistributedSampler) and s.num_replicas > 1), None)
    if found is not None and num_workers > 1:
        raise ValueError(
            f"experimental_distribute_dataset got a DataLoader whose sampler is a DistributedSampler (num_replicas="
            f"{found.num_replicas}): it already gives this process 1/{found.num_replicas} of the data, and splitting "
            f"its batches across the {num_workers} processes again would train each on 1/{num_workers} of that. "
            "Drop the DistributedSampler (shuffle=True, or your own sampler, over the whole dataset: dlaunch gives each "
            "replica its rows of every global batch), or keep it and pass strategy.distribute_datasets_from_function "
            "a function that returns this loader (docs/SCRIPTS.md)")


def warn_data_once(num_files: int, num_workers: int, worker: int = 0) -> None:
    """DATA makes every worker read everything: say so, once per job (worker 0, once in its process): each rank
    said it, two lines on every run of a single file under cluster=1x2, with the plan's `AUTO -> DATA` above them."""
    global _warned_data
    if _warned_data or num_workers == 1 or worker != 0:
        return
    _warned_data = True
    log.warning(
        "auto_shard_policy DATA: every one of the %d workers reads all %d file(s) and keeps one element in %d; "
        "FILE sharding (at least one file per worker) avoids the redundant reads",
        num_workers, num_files, num_workers,
    )


_warned_whole = False


def warn_whole_once(dataset: object, policy: AutoShardPolicy, num_workers: int, worker: int = 0) -> None:
    """A dataset not read from files, iterated whole by every worker, each keeping its share of every global batch:
    TF's ``.shard`` at the end of the pipeline under AUTO, and its warning ("each worker will do redundant work"),
    said once per job, by worker 0. Not under OFF, where every worker seeing everything is what was asked for."""
    global _warned_whole
    if _warned_whole or num_workers == 1 or worker != 0 or policy is not AutoShardPolicy.AUTO:
        return
    _warned_whole = True
    log.warning(
        "auto_shard_policy AUTO: the dataset (%s) is not read from files, so each of the %d workers iterates all of "
        "it and keeps its share of every global batch, the whole input pipeline run on every worker. A map-style "
        "dataset (or a DataLoader over one) or input.files loads only each worker's rows; train_data as a function "
        "of an InputContext (in a script, strategy.distribute_datasets_from_function) builds each worker's own "
        "pipeline (docs/INPUT.md)",
        type(dataset).__name__, num_workers)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Worker ``worker`` of ``num_workers`` under a resolved ``policy`` (FILE, DATA or OFF)."""

    policy: AutoShardPolicy
    num_workers: int = 1
    worker: int = 0

    def __post_init__(self) -> None:
        if self.policy is AutoShardPolicy.AUTO:
            raise ValueError("a ShardPlan needs a resolved policy; call resolve_policy first")
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker {self.worker} is not in [0, {self.num_workers})")

    def files(self, files: Sequence[T]) -> list[T]:
        """The files this worker reads: its own under FILE, all of them otherwise."""
        if self.policy is AutoShardPolicy.FILE:
            return list(files[self.worker :: self.num_workers])
        return list(files)

    def local_batch_size(self, global_batch_size: int) -> int:
        """Rows this worker contributes to each global batch."""
        if global_batch_size % self.num_workers:
            raise ValueError(
                f"global batch {global_batch_size} is not divisible by {self.num_workers} workers "
                f"({global_batch_size} % {self.num_workers} = {global_batch_size % self.num_workers})"
            )
        return global_batch_size // self.num_workers

    def worker_batches(self, order: torch.Tensor, global_batch_size: int, drop_remainder: bool) -> list[torch.Tensor]:
        """This worker's row indices for each step, given its rows' order for the epoch.

        ``order`` holds every row this worker loaded: all rows under DATA and OFF
        (the same order on every worker), its own files' rows under FILE.
        """
        n, local = len(order), self.local_batch_size(global_batch_size)
        if self.policy is AutoShardPolicy.FILE:
            return _cut(order, local, _steps(n, local, drop_remainder))
        steps = _steps(n, global_batch_size, drop_remainder)
        if self.policy is AutoShardPolicy.DATA:
            return _cut(order[self.worker :: self.num_workers], local, steps)
        # OFF: the same global batches everywhere; this worker keeps its block of each.
        blocks = []
        for s in range(steps):
            end = min((s + 1) * global_batch_size, n)
            start = min(s * global_batch_size + self.worker * local, end)
            blocks.append(order[start : min(start + local, end)])
        return blocks

    def element_count(self, counts: Sequence[int]) -> int:
        """How many elements this worker keeps, given each file's element count."""
        if self.policy is AutoShardPolicy.FILE:
            return sum(self.files(counts))
        total = sum(counts)
        if self.policy is AutoShardPolicy.DATA:
            return len(range(self.worker, total, self.num_workers))
        return total



def _steps(n: int, batch: int, drop_remainder: bool) -> int:
    return n // batch if drop_remainder else math.ceil(n / batch)


def _cut(rows: torch.Tensor, size: int, steps: int) -> list[torch.Tensor]:
    return [rows[s * size : (s + 1) * size] for s in range(steps)]


def collapse(names: Sequence[str], keep: int = 3) -> str:
    """``a, b, c`` or ``a, b, ..., z (12 files)``: short enough for one table cell."""
    names = list(names)
    if len(names) <= keep:
        return ", ".join(names)
    return f"{', '.join(names[: keep - 1])}, ..., {names[-1]} ({len(names)} files)"


MAX_ROWS = 16


def shard_rows(policy: AutoShardPolicy, names: Sequence[str], counts: Sequence[int] | None, nodes: int, devices_per_node: int) -> list[tuple[str, str, str, str]]:
    """The plan's table: (rank, node, what it reads, elements), one row per worker under FILE.

    Without ``counts`` (the files were not counted) the elements column stays empty.

    Under DATA and OFF every worker reads every file, so one row says it for all.
    More than ``MAX_ROWS`` workers keep the first and last rows.
    """
    workers = nodes * devices_per_node
    plans = [ShardPlan(policy, workers, i) for i in range(workers)]
    if policy is not AutoShardPolicy.FILE or workers == 1:
        sizes = sorted({p.element_count(counts) for p in plans}) if counts is not None else [""]
        elements = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} each"
        ranks, where = ("0", "0") if workers == 1 else (f"0-{workers - 1}", "all" if nodes > 1 else "0")
        if workers == 1:
            reads = f"all {len(names)} files"
        elif policy is AutoShardPolicy.DATA:
            reads = f"all {len(names)} files; rank r keeps elements k%{workers}==r"
        else:
            reads = f"all {len(names)} files; rank r keeps block r of {workers} of each global batch"
        return [(ranks, where, reads, elements)]
    rows = [(str(p.worker), str(p.worker // devices_per_node), collapse(p.files(names)),
             str(p.element_count(counts)) if counts is not None else "") for p in plans]
    if len(rows) > MAX_ROWS:
        rows = [*rows[: MAX_ROWS - 4], ("...", "", f"{len(rows) - MAX_ROWS + 1} more workers", ""), *rows[-3:]]
    return rows


def warn_num_workers_unused(data: object, num_workers: int) -> None:
    """``input.num_workers`` sets the workers of the loader dlaunch makes for a map-style dataset; a recipe's own
    iterable or DataLoader loads as its build made it. Said by rank 0."""
    import torch.distributed as dist

    if num_workers and (not dist.is_initialized() or dist.get_rank() == 0):
        from torch.utils.data import IterableDataset

        advice = (" (for an IterableDataset: a DataLoader(..., batch_size=None, num_workers=N) of its own, each worker "
                  "yielding its part of the stream)" if isinstance(data, IterableDataset) else "")
        log.warning("input.num_workers=%d is for a map-style dataset, which dlaunch batches and loads; the training "
                    "data (%s) loads without it%s", num_workers, type(data).__name__, advice)
