"""Distributed datasets: what ``experimental_distribute_dataset`` and
``distribute_datasets_from_function`` return.

Both yield, per step, one batch per local replica: a ``PerReplica`` when more
than one replica is in sync, the plain batch otherwise. A ``FileDataset`` is
first sharded across workers (``InputOptions.auto_shard_policy``); any other
dataset yields global batches, and each worker keeps its replicas' rows.
"""

from __future__ import annotations

import collections
import collections.abc
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from torch.utils.data import DataLoader, IterableDataset

from launcher.distribute.input_context import InputContext, InputOptions, InputReplicationMode
from launcher.input.auto_shard import (AutoShardPolicy, ShardPlan, refuse_sharded_loader, resolve_policy, warn_data_once,
                                       warn_whole_once)
from launcher.input import worker_seeds
from launcher.input.delivery import deliver, element_spec_of
from launcher.input.files import FileDataset, FileShard
from launcher.input.position import EpochBatchSampler, Position
from launcher.input.split import Step, batch_size_of, cut, rows_for_replica, batch_shares, slice_batch, split_batch

log = logging.getLogger("dlaunch")

if TYPE_CHECKING:
    from launcher.distribute.strategy import Strategy


class _Empty:
    """What a replica's own dataset gives once it has no more batches (``distribute_datasets_from_function``)."""


class _LocalRowsSampler:
    """Wraps a global-batch sampler and keeps only this process's replicas' rows; a batch with none of them (a last
    partial one) loads its first row instead, the pad its replicas step on at weight 0."""

    def __init__(self, batch_sampler: Iterable[list[int]], first_replica: int, num_local: int, num_replicas: int, global_batch_size: int):
        self.batch_sampler = batch_sampler
        self.global_batch_size, self.num_replicas = global_batch_size, num_replicas
        self.first, self.num_local = first_replica, num_local
        # Each global batch's rows and whether this process loads only its pad, in the order the loader asks for
        # them (and, in order, delivers them): a step that loads only this process's rows still knows the batch's.
        self.global_rows: collections.deque[tuple[int, bool]] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        first, last = self.first, self.first + self.num_local - 1
        self.global_rows.clear()  # a new pass: whatever an abandoned one asked for is not coming
        for indices in self.batch_sampler:
            if not isinstance(indices, (list, tuple)):
                indices = list(indices)
            n = len(indices)
            b = batch_shares(self.global_batch_size, n, self.num_replicas)
            mine = indices[rows_for_replica(first, b, n)[0] : rows_for_replica(last, b, n)[1]]
            self.global_rows.append((n, not mine))
            yield mine or indices[:1]

    def __len__(self) -> int:
        return len(self.batch_sampler)


def _local_loader(loader: DataLoader, first: int, num_local: int, num_replicas: int) -> tuple[DataLoader, int] | None:
    """A copy of ``loader`` that loads only this process's rows of each global batch."""
    if isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
        return None
    global_batch = getattr(loader.batch_sampler, "batch_size", None)
    if not global_batch:
        return None
    sampler = _LocalRowsSampler(loader.batch_sampler, first, num_local, num_replicas, global_batch)
    extra = {"prefetch_factor": loader.prefetch_factor, "persistent_workers": loader.persistent_workers} if loader.num_workers else {}
    local = DataLoader(
        loader.dataset,
        batch_sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=worker_seeds.per_rank(loader.worker_init_fn) if loader.num_workers else loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,  # the loader draws its base seed from it: keep the same stream
        **extra,
    )
    return local, global_batch


class DistributedDataset:
    """Global batches from ``dataset``, sharded across workers, split across replicas, fetched to devices."""

    def __init__(self, dataset: Iterable, strategy: "Strategy", options: InputOptions):
        if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:  # as TF: refused, not ignored
            raise ValueError("InputReplicationMode.PER_REPLICA is only supported in distribute_datasets_from_function: "
                             "experimental_distribute_dataset splits one dataset's global batches across the replicas")
        ext = strategy.extended
        self._ext = ext
        self._dataset = dataset
        self._options = options
        self._num_replicas = strategy.num_replicas_in_sync
        self._num_local = ext._num_local
        self._first = ext._replica_offset
        self._devices = ext._input_devices()
        self._proc = ext._proc
        self._local = None
        self._global_batch_size: int | None = _declared_batch_size(dataset)
        self._shard: FileShard | None = None
        self._epoch = 0
        self._skip = 0  # batches of the next epoch already delivered before a resume
        self._peeked: Any = None  # the iterator element_spec began over a one-shot source
        if isinstance(dataset, FileDataset):
            self._shard = _shard_files(dataset, options.auto_shard_policy, ext._proc.world_size, ext._proc.rank)
            return
        resolve_policy(options.auto_shard_policy, None, ext._proc.world_size)  # FILE needs files: say so now
        refuse_sharded_loader(dataset, ext._proc.world_size)
        if isinstance(dataset, DataLoader) and self._num_replicas > 1:
            found = _local_loader(dataset, self._first, self._num_local, self._num_replicas)
            if found is not None:
                self._local, self._global_batch_size = found
        if self._local is None:
            warn_whole_once(dataset, options.auto_shard_policy, ext._proc.world_size, ext._proc.rank)

    @property
    def global_batch_size(self) -> int | None:
        """Rows in a global batch: as a loader declares it, else as the first batch read holds (else None)."""
        return self._global_batch_size

    @property
    def num_rows(self) -> int | None:
        """The rows the global batches are cut from: a map-style dataset's, the input files' (but under FILE)."""
        if self._shard is not None:
            return self._shard.num_rows if self._shard.plan.policy is not AutoShardPolicy.FILE else None
        return getattr(self._sampler(), "num_examples", None)

    @property
    def one_shot(self) -> bool:
        """Whether the source is an iterator (a generator): one pass, never another."""
        return isinstance(self._dataset, collections.abc.Iterator)

    def why_no_batch(self) -> str | None:
        """Why a pass gives no step where the data's size is not the reason (FILE's shortest worker), else None."""
        shard = self._shard
        if shard is None or shard.plan.policy is not AutoShardPolicy.FILE or self._proc.world_size == 1:
            return None
        return (f"input.auto_shard_policy=FILE gives each of the {self._proc.world_size} workers its own files, and "
                "every epoch ends with the shortest worker's: one worker's files fill no batch of its "
                f"{shard.local_batch_size()} row(s) of each global batch (this one's hold {shard.num_rows}); use more, "
                "equal-sized files, a smaller input.global_batch_size, or input.auto_shard_policy=DATA "
                "(launch.dry_run=true counts each worker's elements)")

    @property
    def seekable(self) -> bool:
        """Whether ``set_position`` can skip to a position without reading the batches before it."""
        return self._shard is not None or hasattr(self._sampler(), "set_position")

    def set_position(self, position: Position) -> None:
        """The next ``iter()`` starts at ``position`` (epoch, batches already delivered in it)."""
        if self._shard is not None:
            self._epoch, self._skip = position.epoch, position.offset
        elif hasattr(self._sampler(), "set_position"):
            self._sampler().set_position(position)
        else:
            raise TypeError(f"{type(self._dataset).__name__} cannot seek; iterate it instead")

    def _sampler(self) -> Any:
        return getattr(self._dataset, "batch_sampler", None)

    def __iter__(self) -> Iterator[Any]:
        if self._peeked is not None:  # element_spec read a one-shot source's first step
            peeked, self._peeked = self._peeked, None
            return peeked
        if self._shard is not None:
            steps = self._iter_file_shard()
        else:  # the source's iter() now, not at the first batch: a DataLoader draws its seed here (see DataStream.seek);
            # a process that receives its input from another (a mesh replica's other logical devices) starts none
            reads = self._ext._reads_input
            if self._local is not None:
                steps = self._iter_local_rows(iter(self._local) if reads else iter(()))
            else:
                steps = self._iter_global_batches(iter(self._dataset) if reads else iter(()))
        if self._ext.warn_uneven_shares and self._proc.rank == 0 and self._num_replicas > 1:
            steps = _say_uneven_shares(steps, lambda: self._global_batch_size, self._num_replicas)
        return deliver(self._ext._share_input(steps), self._devices, self._options, self._num_replicas)

    @property
    def element_spec(self) -> Any:
        """The structure of a step, with a ``TensorSpec`` (shape, dtype) per tensor and the batch dimension None.

        Per-replica parts are a ``PerReplica`` of specs, as TF's ``PerReplicaSpec``.
        Found by reading the first step of a fresh pass; over a one-shot source (an iterator, such as a
        generator) that step is kept, and the next ``iter()`` goes on from it.
        """
        if self.one_shot:
            return _peek_spec(self)
        epoch, skip = self._epoch, self._skip
        sampler = self._sampler()
        position = getattr(sampler, "position", None)  # a seekable sampler's next epoch: reading moves it on
        try:
            return element_spec_of(next(iter(self)))
        finally:
            self._epoch, self._skip = epoch, skip
            if position is not None:
                sampler.set_position(position)

    def __len__(self) -> int:
        if self._shard is not None:
            return len(self._shard.batches(self._epoch))  # this worker's steps, before any agreement
        return len(self._dataset)  # type: ignore[arg-type]

    def _iter_file_shard(self) -> Iterator[Step]:
        shard, epoch, skip = self._shard, self._epoch, self._skip
        self._epoch, self._skip = self._epoch + 1, 0
        batches = shard.batches(epoch)
        steps, local = len(batches), shard.local_batch_size()
        # Each step's global rows: DATA and OFF load every row and count them; under FILE the workers count theirs.
        total, size = shard.num_rows, shard.dataset.global_batch_size
        rows = (_file_rows(self._proc, batches, local, epoch) if shard.plan.policy is AutoShardPolicy.FILE
                else [min(size, total - s * size) for s in range(steps)])
        for s in range(skip, len(rows)):
            step = split_batch(shard.collate(batches[s]), range(self._num_local), self._num_local, local)
            pad = step.pad
            if len(batches[s]) == 0 and shard.num_rows:  # no rows of this worker's in the step: its replicas step at
                pad = shard.collate(batches[s].new_zeros(1))  # weight 0 on a row it holds (its first), not on none
            yield Step(step, rows[s], pad)

    def _iter_local_rows(self, rows_of_steps: Iterator[Any]) -> Iterator[Step]:
        global_rows = self._local.batch_sampler.global_rows
        for rows in rows_of_steps:
            found, padded = global_rows.popleft() if global_rows else (None, False)
            sizes = batch_shares(self._global_batch_size, found or 0, self._num_replicas)[self._first : self._first + self._num_local]
            if padded:  # none of the batch's rows are this process's: what it loaded is its replicas' pad
                yield Step([slice_batch(rows, 0, 0)] * self._num_local, found, rows)
            elif self._num_local == 1:
                yield Step([rows], found)  # the sampler loaded exactly this replica's rows: nothing to cut
            else:  # this process's rows: its replicas' shares of the global batch, in order
                n = batch_size_of(rows)
                yield cut(rows, [rows_for_replica(k, sizes, n) for k in range(self._num_local)], found)

    def _iter_global_batches(self, batches: Iterator[Any]) -> Iterator[Step]:
        mine = range(self._first, self._first + self._num_local)
        for batch in batches:
            step = split_batch(batch, mine, self._num_replicas, self._global_batch_size)
            self._global_batch_size = self._global_batch_size or step.rows  # the first batch's, unless declared
            yield step


def _say_uneven_shares(steps: Iterator[Step], global_batch_size: Callable[[], int | None], replicas: int) -> Iterator[Step]:
    """Script mode: a script's loss is its own, and a replica's mean over a smaller share (a last partial batch
    fills the replicas in order, as TF rebatches) weighs as much as another's over a full one; a share of no rows
    gives a NaN mean. Said once per process (rank 0's), naming the two fixes."""
    for step in steps:
        size = global_batch_size()
        if step.rows is not None and size and not _SAID_SHARES:
            sizes = batch_shares(size, step.rows, replicas)
            shares = [stop - start for start, stop in (rows_for_replica(k, sizes, step.rows) for k in range(replicas))]
            if min(shares) < max(shares):
                _SAID_SHARES.append(True)
                empty = f"; replica {shares.index(0)} gets no rows, and a mean over them is NaN" if 0 in shares else ""
                log.warning(
                    "a batch of %d row(s) (global batch %d) splits over the %d replicas as %s, filled in order as TF "
                    "rebatches%s. A script's own loss, a mean per replica, then weighs a smaller share as much as a "
                    "full one: weight it by the global batch with dl.compute_average_loss(per_example_loss, "
                    "global_batch_size=%d) (a replica with no rows adds 0), or drop the last partial batch with "
                    "DataLoader(..., drop_last=True); a loop that gathers its rows (an evaluation's strategy.gather) "
                    "needs neither (docs/SCRIPTS.md; said once)",
                    step.rows, size, replicas, shares, empty, size,
                )
        yield step


_SAID_SHARES: list[bool] = []


def _declared_batch_size(dataset: Any) -> int | None:
    """The global batch size of dlaunch's own seekable loader (one row per index), not as a batch holds it: a
    resumed pass may begin at an epoch's last, partial batch, which must not become the size every later batch
    is cut to. Another loader's batches may hold other than ``batch_size`` rows (a collate_fn that packs them):
    its first batch says."""
    sampler = getattr(dataset, "batch_sampler", None)
    return sampler.batch_size if isinstance(sampler, EpochBatchSampler) else None


def _shard_files(dataset: FileDataset, policy: AutoShardPolicy, num_workers: int, worker: int) -> FileShard:
    resolved = resolve_policy(policy, len(dataset.files), num_workers)
    if resolved is AutoShardPolicy.DATA:
        warn_data_once(len(dataset.files), num_workers, worker)
    return dataset.shard(ShardPlan(resolved, num_workers, worker))


def _file_rows(proc: Any, batches: list[Any], local: int, epoch: int) -> list[int]:
    """Under FILE, each agreed step's global rows: every worker's batch is full but the last one, whose rows the
    workers sum (one collective per epoch, after the agreement on the step count)."""
    steps = _agree_on_steps(proc, len(batches), epoch) if proc.world_size > 1 else len(batches)
    if not steps:
        return []
    return [local * proc.world_size] * (steps - 1) + [proc.all_reduce_count(len(batches[steps - 1]))]


def _agree_on_steps(proc: Any, mine: int, epoch: int) -> int:
    """FILE shards may hold different numbers of batches: every worker stops at the shortest.

    The shard is loaded, so its length is known: one MIN all-reduce per epoch
    gives what a per-step "has data" flag would, without a collective per step.
    """
    agreed = proc.all_reduce_min(mine)
    if agreed < mine and not _SAID_UNEVEN:
        _SAID_UNEVEN.append(epoch)  # the shards are the same every epoch: said once per process, not once per epoch
        log.warning(
            "epoch %d: FILE shards are uneven; rank %d has %d batch(es), the shortest worker %d: "
            "dropping this worker's last %d batch(es) so that every worker stops together (every epoch alike; said once)",
            epoch, proc.rank, mine, agreed, mine - agreed,
        )
    return agreed


_SAID_UNEVEN: list[int] = []


class DistributedDatasetsFromFunction:
    """Datasets built by ``dataset_fn(InputContext)``: per worker, or per replica."""

    def __init__(self, dataset_fn: Callable[[InputContext], Iterable], strategy: "Strategy", options: InputOptions):
        ext = strategy.extended
        n = strategy.num_replicas_in_sync
        self._num_replicas = n
        self._num_local = ext._num_local
        self._devices = ext._input_devices()
        self._options = options
        if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            self.input_contexts = [InputContext(n, ext._replica_offset + i, n) for i in range(ext._num_local)]
        else:
            self.input_contexts = [InputContext(ext._proc.world_size, ext._proc.rank, n)]
        self._ext = ext
        # A process that does not read (a replica's other logical devices) never calls dataset_fn:
        # one replica reads one input, however many processes it spans.
        self._datasets = [dataset_fn(ctx) for ctx in self.input_contexts] if ext._reads_input else []
        self._peeked: Any = None
        self._last: Any = None  # the last element read: empty batches and pads are cut from it

    @property
    def one_shot(self) -> bool:
        """Whether a dataset ``dataset_fn`` returned is an iterator (a generator): one pass, never another."""
        return any(isinstance(d, collections.abc.Iterator) for d in self._datasets)

    def __iter__(self) -> Iterator[Any]:
        if self._peeked is not None:  # element_spec read one-shot sources' first step
            peeked, self._peeked = self._peeked, None
            return peeked
        return deliver(self._ext._share_input(self._steps()), self._devices, self._options, self._num_replicas,
                       self._ext._input_agreement())

    @property
    def element_spec(self) -> Any:
        """As ``DistributedDataset.element_spec``: read from the first step of fresh iterators over the datasets
        (a ``FileDataset`` counts its passes to reshuffle each one: reading the spec is not one; a one-shot
        source's step is kept for the next ``iter()``)."""
        if self.one_shot:
            return _peek_spec(self)
        passes = [(d, d._passes) for d in self._datasets if isinstance(d, FileDataset)]
        try:
            return element_spec_of(iter(self).peek())  # no agreement between the processes: any rank may read it
        finally:
            for dataset, count in passes:
                object.__setattr__(dataset, "_passes", count)

    def _steps(self) -> Iterator[list[Any]]:
        iterators = [iter(d) for d in self._datasets]
        sources = iterators if len(iterators) == self._num_local else iterators * self._num_local
        agreed = self._ext._input_agreement() is not None and self._ext._proc.world_size > 1
        while True:
            pieces = [next(source, _Empty) for source in sources]
            found = [p for p in pieces if p is not _Empty]
            if not found and not agreed:
                return
            self._last = last = found[0] if found else self._last  # kept from pass to pass
            # A last partial step: replicas whose data ran out get an empty batch, as in TF; where the processes
            # agree each step (launcher/input/delivery.py), one whose data ran out goes on with empty batches until
            # every one's has (TF's multi-worker iterator), and one with none ever gives no pieces.
            if last is None:
                yield []
            elif len(found) < len(pieces):  # a replica's empty batch, and a row to step on at weight 0 (its pad)
                yield Step([slice_batch(last, 0, 0) if p is _Empty else p for p in pieces], None, slice_batch(last, 0, 1))
            else:
                yield pieces


def _peek_spec(dataset: Any) -> Any:
    """The spec of the first step of a one-shot source, which the next ``iter(dataset)`` returns first: the
    source cannot be read again (a generator), so reading its spec must not lose steps."""
    steps = iter(dataset)
    first = steps.peek()
    dataset._peeked = steps
    return element_spec_of(first)
