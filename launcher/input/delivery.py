"""Delivery: each step's per-replica pieces on their devices (prefetched), and what iterating a distributed dataset
gives, a ``PerReplica`` structure per step; ``element_spec``'s ``TensorSpec``."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch

from launcher.distribute.input_context import InputOptions
from launcher.distribute.values import PerReplica, map_structure, regroup
from launcher.input.prefetch import Prefetcher
from launcher.input.split import like


def deliver(steps: Iterable[list[Any]], devices: list[torch.device], options: InputOptions, num_replicas: int,
            agree: Callable[[int], int] | None = None) -> "DistributedIterator":
    """Each step's pieces on their devices (prefetched), as a ``PerReplica`` structure. ``agree``: the step's rows
    over every process, given this one's (0: the end; ``steps`` go on with empty pieces once this one's are done)."""
    if options.experimental_fetch_to_device:
        # On CPU nothing moves: the buffer reads steps ahead, on this thread, in order.
        steps = Prefetcher(steps, devices, options.experimental_per_replica_buffer_size, options.copy_stream)
    elif options.experimental_place_dataset_on_device:  # each replica's own, as it is read
        steps = (like([_on_device(p, d) for p, d in zip(pieces, devices)], pieces) for pieces in steps)
    return DistributedIterator(steps, num_replicas, agree)


class DistributedIterator:
    """What iterating a distributed dataset gives: each step's batch, a ``PerReplica`` structure (the plain batch
    under one replica). ``rows``: the rows of the global batch that the step last returned was cut from (under
    ``distribute_datasets_from_function``, every process's batches' rows, added up each step; None under a mesh of
    several logical devices per replica, whose replicas read on their own); ``pad``:
    that step's row for a replica with none (``launcher.input.split.Step``)."""

    def __init__(self, steps: Iterable[list[Any]], num_replicas: int, agree: Callable[[int], int] | None = None):
        self._steps, self._num_replicas, self._agree = iter(steps), num_replicas, agree
        self.rows: int | None = None
        self.pad: Any = None
        self._back: Any = None  # the pieces ``peek`` read, not yet handed out

    def __iter__(self) -> "DistributedIterator":
        return self

    def peek(self) -> Any:
        """The next step, left to come next: no agreement between the processes (``element_spec`` reads it, on
        one rank or on all)."""
        if self._back is None:
            self._back = next(self._steps)
        if not self._back:
            raise StopIteration
        return self._element(self._back)

    def __next__(self) -> Any:
        pieces, self._back = (self._back, None) if self._back is not None else (next(self._steps), None)
        self.rows, self.pad = getattr(pieces, "rows", None), getattr(pieces, "pad", None)
        if self._agree is not None:  # datasets of the user's (distribute_datasets_from_function): count the rows
            self.rows = self._agree(_rows_of(pieces))
            if not self.rows:
                raise StopIteration
            if not pieces:  # this process's data never gave an element, while another's has one
                raise ValueError("this process's dataset gave no element while other workers' datasets have some: its "
                                 "replicas would need an empty batch of a structure never seen here")
        return self._element(pieces)

    def _element(self, pieces: list[Any]) -> Any:
        return pieces[0] if self._num_replicas == 1 else regroup(pieces)


def _rows_of(pieces: list[Any]) -> int:
    """The rows a step's pieces hold (a process whose data ran out gives empty ones; an element with no batch
    dimension counts one)."""
    from launcher.input.split import batch_size_of

    def rows(piece: Any) -> int:
        try:
            return batch_size_of(piece)
        except ValueError:
            return 1

    return sum(rows(p) for p in pieces)


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
