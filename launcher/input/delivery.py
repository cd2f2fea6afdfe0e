"""Delivery: each step's per-replica pieces on their devices (prefetched), and what iterating a distributed dataset
gives, a ``PerReplica`` structure per step; ``element_spec``'s ``TensorSpec``."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch

from launcher.distribute.input_context import InputOptions
from launcher.distribute.values import PerReplica, map_structure, regroup
from launcher.input.prefetch import Prefetcher
from launcher.input.split import like


def deliver(steps: Iterable[list[Any]], devices: list[torch.device], options: InputOptions, num_replicas: int) -> "DistributedIterator":
    """Each step's pieces on their devices (prefetched), as a ``PerReplica`` structure."""
    if options.experimental_fetch_to_device:
        # On CPU nothing moves: the buffer reads steps ahead, on this thread, in order.
        steps = Prefetcher(steps, devices, options.experimental_per_replica_buffer_size, options.copy_stream)
    elif options.experimental_place_dataset_on_device:  # each replica's own, as it is read
        steps = (like([_on_device(p, d) for p, d in zip(pieces, devices)], pieces) for pieces in steps)
    return DistributedIterator(steps, num_replicas)


class DistributedIterator:
    """What iterating a distributed dataset gives: each step's batch, a ``PerReplica`` structure (the plain batch
    under one replica). ``rows``: the rows of the global batch that the step last returned was cut from, where the
    dataset knows them (None where not: ``distribute_datasets_from_function``'s batches are the user's); ``pad``:
    that step's row for a replica with none (``launcher.input.split.Step``)."""

    def __init__(self, steps: Iterable[list[Any]], num_replicas: int):
        self._steps, self._num_replicas = iter(steps), num_replicas
        self.rows: int | None = None
        self.pad: Any = None
        self._back: tuple[Any, int | None, Any] | None = None

    def __iter__(self) -> "DistributedIterator":
        return self

    def put_back(self, element: Any) -> None:
        """The step just returned comes again next (``element_spec`` over a one-shot source reads it)."""
        self._back = (element, self.rows, self.pad)

    def __next__(self) -> Any:
        if self._back is not None:
            (element, self.rows, self.pad), self._back = self._back, None
            return element
        pieces = next(self._steps)
        self.rows, self.pad = getattr(pieces, "rows", None), getattr(pieces, "pad", None)
        return pieces[0] if self._num_replicas == 1 else regroup(pieces)


def _on_device(piece: Any, device: torch.device) -> Any:
    return map_structure(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, piece)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What ``tf.TensorSpec`` says of a batch: its shape (None for the batch dimension, which may vary) and dtype."""

    shape: tuple
    dtype: torch.dtype


def element_spec_of(element: Any) -> Any:
    """``element`` with each tensor replaced by its ``TensorSpec`` (other leaves by their type)."""
    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return TensorSpec((None, *value.shape[1:]) if value.dim() else (), value.dtype)
        return type(value)

    return map_structure(
        lambda leaf: PerReplica([map_structure(spec, v) for v in leaf.values]) if isinstance(leaf, PerReplica) else spec(leaf),
        element,
    )
