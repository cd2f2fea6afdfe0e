"""Distributed datasets: what ``experimental_distribute_dataset`` and
``distribute_datasets_from_function`` return.

Both yield, per step, one batch per local replica: a ``PerReplica`` when more
than one replica is in sync, the plain batch otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from launcher.distribute.input_context import InputContext, InputOptions, InputReplicationMode
from launcher.distribute.values import map_structure, regroup
from launcher.input.split import batch_size_of, per_replica_size, rows_for_replica, slice_batch, split_batch

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
        b = self.per_replica
        for indices in self.batch_sampler:
            indices = list(indices)
            start, _ = rows_for_replica(self.first, b, len(indices))
            _, stop = rows_for_replica(self.first + self.num_local - 1, b, len(indices))
            yield indices[start:stop]

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
    """Global batches from ``dataset``, split across replicas and fetched to their devices."""

    def __init__(self, dataset: Iterable, strategy: "Strategy", options: InputOptions):
        ext = strategy.extended
        self._dataset = dataset
        self._options = options
        self._num_replicas = strategy.num_replicas_in_sync
        self._num_local = ext._num_local
        self._first = ext._replica_offset
        self._devices = ext._input_devices()
        self._local = None
        self._global_batch_size: int | None = None
        if isinstance(dataset, DataLoader) and self._num_replicas > 1:
            found = _local_loader(dataset, self._first, self._num_local, self._num_replicas)
            if found is not None:
                self._local, self._global_batch_size = found

    def __iter__(self) -> Iterator[Any]:
        if self._local is not None:
            return self._iter_local_rows()
        return self._iter_global_batches()

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]

    def _iter_local_rows(self) -> Iterator[Any]:
        b = per_replica_size(self._global_batch_size, self._num_replicas)
        template = None
        for rows in self._local:
            if rows is _Empty:
                if template is None:
                    raise ValueError("the first global batch leaves this process's replicas no rows")
                rows = template
            else:
                template = slice_batch(rows, 0, 0)
            n = batch_size_of(rows)
            pieces = [slice_batch(rows, *rows_for_replica(k, b, n)) for k in range(self._num_local)]
            yield self._package(pieces)

    def _iter_global_batches(self) -> Iterator[Any]:
        for batch in self._dataset:
            if self._global_batch_size is None:
                self._global_batch_size = batch_size_of(batch)
            mine = range(self._first, self._first + self._num_local)
            yield self._package(split_batch(batch, mine, self._num_replicas, self._global_batch_size))

    def _package(self, pieces: list[Any]) -> Any:
        if self._options.experimental_fetch_to_device:
            pieces = [_to_device(p, d) for p, d in zip(pieces, self._devices)]
        return pieces[0] if self._num_replicas == 1 else regroup(pieces)


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
        iterators = [iter(d) for d in self._datasets]
        sources = iterators if len(iterators) == self._num_local else iterators * self._num_local
        while True:
            pieces = [next(source, _Empty) for source in sources]
            found = [p for p in pieces if p is not _Empty]
            if not found:
                return
            # A last partial step: replicas whose data ran out get an empty batch, as in TF.
            pieces = [slice_batch(found[0], 0, 0) if p is _Empty else p for p in pieces]
            if self._options.experimental_fetch_to_device:
                pieces = [_to_device(p, d) for p, d in zip(pieces, self._devices)]
            yield pieces[0] if self._num_replicas == 1 else regroup(pieces)


def _to_device(piece: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return piece

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.pin_memory().to(device, non_blocking=True) if t.device.type == "cpu" else t.to(device)

    return map_structure(move, piece)
