"""Splitting a global batch across replicas, the tf.distribute way.

Replica ``i`` takes rows ``[i*b, (i+1)*b)`` where ``b`` is the per-replica batch
size of a *full* global batch. So a last partial batch of 6 over two replicas of
4 gives ``[0,1,2,3]`` and ``[4,5]`` (not 3 and 3), and a replica may get 0 rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from launcher.distribute.values import map_structure


def batch_size_of(batch: Any) -> int:
    """The leading dimension shared by every tensor of ``batch``."""
    sizes: set[int] = set()

    def visit(leaf: Any) -> None:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            sizes.add(leaf.shape[0])

    map_structure(visit, batch)
    if len(sizes) != 1:
        raise ValueError(f"every tensor of a batch must share its first dimension; got sizes {sorted(sizes)}")
    return sizes.pop()


def per_replica_size(global_batch_size: int, num_replicas: int) -> int:
    return math.ceil(global_batch_size / num_replicas)


def rows_for_replica(replica_id: int, per_replica: int, batch_len: int) -> tuple[int, int]:
    start = min(replica_id * per_replica, batch_len)
    return start, min(start + per_replica, batch_len)


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    return map_structure(lambda t: t[start:stop] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, batch)


def split_batch(batch: Any, replica_ids: range, num_replicas: int, global_batch_size: int | None = None) -> list[Any]:
    """The pieces of ``batch`` that belong to ``replica_ids`` (of ``num_replicas``)."""
    length = batch_size_of(batch)
    b = per_replica_size(global_batch_size or length, num_replicas)
    return [slice_batch(batch, *rows_for_replica(r, b, length)) for r in replica_ids]
