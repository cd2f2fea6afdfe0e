"""Distributed datasets: what ``experimental_distribute_dataset`` and
``distribute_datasets_from_function`` return.

Both yield, per step, one batch per local replica: a ``PerReplica`` when more
than one replica is in sync, the plain batch otherwise. A ``FileDataset`` is
first sharded across workers (``InputOptions.auto_shard_policy``); any other
dataset yields global batches, and each worker keeps its replicas' rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import logging

import torch
from torch.utils.data import DataLoader, IterableDataset

from launcher.distribute.input_context import InputContext, InputOptions, InputReplicationMode
from launcher.distribute.values import regroup
from launcher.input.auto_shard import AutoShardPolicy, ShardPlan, resolve_policy, warn_data_once
from launcher.input.files import FileDataset, FileShard
from launcher.input.position import Position
from launcher.input.prefetch import Prefetcher
from launcher.input.split import batch_size_of, per_replica_size, rows_for_replica, slice_batch, split_batch

log = logging.getLogger("dlaunch")

if TYPE_CHECKING:
    from launcher.distribute.strategy import Strategy


class _Empty:
    """What a process loads when a last partial batch leaves its replicas no rows."""


def _collate_or_empty(collate: Callable[[list], Any]) -> Callable[[list], Any]:
    def collate_fn(samples: list) -> Any:
        return _Empty if not samples else collate(samples)

    return collate_fn


class _LocalRowsSampler:
    """Wraps a global-batch sampler and keeps only this process's replicas' rows."""

    def __init__(self, batch_sampler: Iterable[list[int]], first_replica: int, num_local: int, num_replicas: int, global_batch_size: int):
        self.batch_sampler = batch_sampler
        self.per_replica = per_replica_size(global_batch_size, num_replicas)
        self.first, self.num_local = first_replica, num_local

    def __iter__(self) -> Iterator[list[int]]:
        b, first, last = self.per_replica, self.first, self.first + self.num_local - 1
        for indices in self.batch_sampler:
            if not isinstance(indices, (list, tuple)):
                indices = list(indices)
            n = len(indices)
            yield indices[rows_for_replica(first, b, n)[0] : rows_for_replica(last, b, n)[1]]

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
        collate_fn=_collate_or_empty(loader.collate_fn),
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,  # the loader draws its base seed from it: keep the same stream
        **extra,
    )
    return local, global_batch


class DistributedDataset:
    """Global batches from ``dataset``, sharded across workers, split across replicas, fetched to devices."""

    def __init__(self, dataset: Iterable, strategy: "Strategy", options: InputOptions):
        ext = strategy.extended
        self._dataset = dataset
        self._options = options
        self._num_replicas = strategy.num_replicas_in_sync
        self._num_local = ext._num_local
        self._first = ext._replica_offset
        self._devices = ext._input_devices()
        self._proc = ext._proc
        self._local = None
        self._global_batch_size: int | None = None
        self._shard: FileShard | None = None
        self._epoch = 0
        self._skip = 0  # batches of the next epoch already delivered before a resume
        if isinstance(dataset, FileDataset):
            self._shard = _shard_files(dataset, options.auto_shard_policy, ext._proc.world_size, ext._proc.rank)
            return
        resolve_policy(options.auto_shard_policy, None, ext._proc.world_size)  # FILE needs files: say so now
        if isinstance(dataset, DataLoader) and self._num_replicas > 1:
            found = _local_loader(dataset, self._first, self._num_local, self._num_replicas)
            if found is not None:
                self._local, self._global_batch_size = found

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
        if self._shard is not None:
            steps = self._iter_file_shard()
        elif self._local is not None:
            steps = self._iter_local_rows()
        else:
            steps = self._iter_global_batches()
        return _deliver(steps, self._devices, self._options, self._num_replicas)

    def __len__(self) -> int:
        if self._shard is not None:
            return len(self._shard.batches(self._epoch))  # this worker's steps, before any agreement
        return len(self._dataset)  # type: ignore[arg-type]

    def _iter_file_shard(self) -> Iterator[list[Any]]:
        shard, epoch, skip = self._shard, self._epoch, self._skip
        self._epoch, self._skip = self._epoch + 1, 0
        batches = shard.batches(epoch)
        steps = len(batches)
        if shard.plan.policy is AutoShardPolicy.FILE and self._proc.world_size > 1:
            steps = _agree_on_steps(self._proc, steps, epoch)
        local = shard.local_batch_size()
        for rows in batches[skip:steps]:
            yield split_batch(shard.collate(rows), range(self._num_local), self._num_local, local)

    def _iter_local_rows(self) -> Iterator[list[Any]]:
        b = per_replica_size(self._global_batch_size, self._num_replicas)
        template = None
        for rows in self._local:
            if rows is _Empty:
                if template is None:
                    raise ValueError("the first global batch leaves this process's replicas no rows")
                rows = template
            elif template is None:
                template = slice_batch(rows, 0, 0)  # the structure of an empty batch, kept for a last partial one
            if self._num_local == 1:
                yield [rows]  # the sampler loaded exactly this replica's rows: nothing to cut
                continue
            n = batch_size_of(rows)
            yield [slice_batch(rows, *rows_for_replica(k, b, n)) for k in range(self._num_local)]

    def _iter_global_batches(self) -> Iterator[list[Any]]:
        for batch in self._dataset:
            if self._global_batch_size is None:
                self._global_batch_size = batch_size_of(batch)
            mine = range(self._first, self._first + self._num_local)
            yield split_batch(batch, mine, self._num_replicas, self._global_batch_size)


def _shard_files(dataset: FileDataset, policy: AutoShardPolicy, num_workers: int, worker: int) -> FileShard:
    resolved = resolve_policy(policy, len(dataset.files), num_workers)
    if resolved is AutoShardPolicy.DATA:
        warn_data_once(len(dataset.files), num_workers)
    return dataset.shard(ShardPlan(resolved, num_workers, worker))


def _agree_on_steps(proc: Any, mine: int, epoch: int) -> int:
    """FILE shards may hold different numbers of batches: every worker stops at the shortest.

    The shard is loaded, so its length is known: one MIN all-reduce per epoch
    gives what a per-step "has data" flag would, without a collective per step.
    """
    agreed = proc.all_reduce_min(mine)
    if agreed < mine:
        log.warning(
            "epoch %d: FILE shards are uneven; rank %d has %d batch(es), the shortest worker %d: "
            "dropping this worker's last %d batch(es) so that every worker stops together",
            epoch, proc.rank, mine, agreed, mine - agreed,
        )
    return agreed


def _deliver(steps: Iterable[list[Any]], devices: list[torch.device], options: InputOptions, num_replicas: int) -> Iterator[Any]:
    """Each step's pieces on their devices (prefetched), as a ``PerReplica`` structure."""
    if options.experimental_fetch_to_device and any(d.type != "cpu" for d in devices):
        steps = Prefetcher(steps, devices, options.experimental_per_replica_buffer_size)  # on CPU nothing moves
    for pieces in steps:
        yield pieces[0] if num_replicas == 1 else regroup(pieces)


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
        self._datasets = [dataset_fn(ctx) for ctx in self.input_contexts]

    def __iter__(self) -> Iterator[Any]:
        return _deliver(self._steps(), self._devices, self._options, self._num_replicas)

    def _steps(self) -> Iterator[list[Any]]:
        iterators = [iter(d) for d in self._datasets]
        sources = iterators if len(iterators) == self._num_local else iterators * self._num_local
        while True:
            pieces = [next(source, _Empty) for source in sources]
            found = [p for p in pieces if p is not _Empty]
            if not found:
                return
            # A last partial step: replicas whose data ran out get an empty batch, as in TF.
            yield [slice_batch(found[0], 0, 0) if p is _Empty else p for p in pieces]
