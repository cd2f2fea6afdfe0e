"""The training data a recipe's ``build`` returns, as the loop reads it: distributed over the replicas.

``Parts.train_data`` is a map-style dataset (dlaunch batches, shuffles and splits it), the ``FileDataset`` of
``input.files`` (sharded across workers), an iterable of global batches (every worker iterates it and keeps its
share), or a function of an ``InputContext`` that returns this worker's own iterable of per-replica batches, as
``strategy.distribute_datasets_from_function`` takes it (a stream each worker reads its own part of).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from launcher.config.schema import RunSpec
from launcher.distribute.input_context import InputOptions
from launcher.input.auto_shard import warn_num_workers_unused
from launcher.input.collate import CheckedCollate
from launcher.input.files import FileDataset
from launcher.input.position import EpochBatchSampler, seekable_loader
from launcher.input.tensor_rows import batched_reads


def distributed(strategy: Any, data: Any, spec: RunSpec) -> Any:
    """``data`` distributed by ``strategy`` as the loop's stream reads it."""
    if is_per_worker(data):
        warn_num_workers_unused(data, spec.input.num_workers)
        return strategy.distribute_datasets_from_function(data, input_options(spec))
    return strategy.experimental_distribute_dataset(global_batches(data, spec), input_options(spec))


def is_per_worker(data: Any) -> bool:
    """A function (of an ``InputContext``), not data: no iterable or dataset is called."""
    return callable(data) and not hasattr(data, "__iter__") and not hasattr(data, "__getitem__")


def global_batches(data: Any, spec: RunSpec) -> Any:
    """A map-style dataset becomes a loader of global batches; epoch ``e`` is shuffled with ``input.seed + e``; a
    recipe's plain ``DataLoader`` is read in that order too (``seekable_loader``).

    The order is a function of (seed, epoch), so a resumed run can seek to any
    batch without reading the ones before it.
    """
    if isinstance(data, Dataset) and not isinstance(data, IterableDataset):
        inp = spec.input
        sampler = EpochBatchSampler(len(data), inp.global_batch_size, inp.shuffle, spec.input_seed, inp.drop_remainder)
        # Its own generator: each iter() draws the loader workers' base seed, which must not move the global RNG.
        generator = torch.Generator().manual_seed(spec.input_seed)
        data, collate = batched_reads(data)
        return DataLoader(data, batch_sampler=sampler, num_workers=inp.num_workers, generator=generator,
                          collate_fn=CheckedCollate(collate, data))
    warn_num_workers_unused(data, spec.input.num_workers)
    return seekable_loader(data, spec.input_seed)


def file_dataset(spec: RunSpec) -> FileDataset | None:
    """The dataset ``input.files`` describes, batched and shuffled as the input section says."""
    inp = spec.input
    if not inp.files:
        return None
    dataset = FileDataset(tuple(inp.files), inp.file_format).batch(inp.global_batch_size, inp.drop_remainder)
    return dataset.shuffle(spec.input_seed) if inp.shuffle else dataset


def input_options(spec: RunSpec) -> InputOptions:
    """The loop's stream reads ahead itself (``DataStream.read_ahead``, after each step): no buffer in the dataset."""
    return InputOptions(auto_shard_policy=spec.input.policy, experimental_per_replica_buffer_size=0,
                        copy_stream=spec.input.copy_stream)


