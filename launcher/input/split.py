"""Splitting a global batch across replicas, the tf.distribute way.

A global batch of ``G`` rows gives replica ``i`` of ``R`` ``G // R`` rows, plus
one for the first ``G % R`` replicas: as even as TF's rebatching (51 over 2
replicas: 26 and 25; 6 over 4: 2, 2, 1, 1). A last partial batch fills the
replicas in order with those sizes, so 6 rows of a global 8 over two replicas
give ``[0,1,2,3]`` and ``[4,5]`` (not 3 and 3), and a replica may get 0 rows.

Each step's pieces travel as a ``Step``: the list of this process's pieces, and
``rows``, the whole global batch's rows, so that a replica can weight its loss
by its share of them (``launcher.runtime.step``).
"""

from __future__ import annotations

from typing import Any

import torch

from launcher.distribute.values import map_structure


class Step(list):
    """One step's pieces (one per local replica); ``rows``: the global batch's rows, None where unknown; ``pad``: where
    a piece has no rows, one row of the batch (on the host) for dlaunch's step to run that replica on at weight 0,
    so that it joins the step's collectives even as the first batch after a resume. The pieces stay as TF gives
    them, empty: a custom loop sees no row twice."""

    def __init__(self, pieces: Any = (), rows: int | None = None, pad: Any = None):
        super().__init__(pieces)
        self.rows, self.pad = rows, pad


def like(pieces: list[Any], step: Any) -> Any:
    """``pieces`` (a step's pieces, moved or copied) as a ``Step`` with ``step``'s rows and pad, where ``step`` is one."""
    return Step(pieces, step.rows, step.pad) if isinstance(step, Step) else pieces


def batch_size_of(batch: Any) -> int:
    """The leading dimension shared by every tensor of ``batch``."""
    sizes = _leading_sizes(batch)
    if not sizes:
        raise ValueError(f"a batch to split across replicas needs a tensor with a first (batch) dimension; this element "
                         f"has none ({_shown(batch)}): batch the dataset by the global batch size, e.g. "
                         "DataLoader(dataset, batch_size=GLOBAL_BATCH_SIZE)")
    if len(sizes) != 1:
        raise ValueError(f"every tensor of a batch must share its first dimension; got sizes {sorted(sizes)}")
    return sizes.pop()


def _shown(element: Any) -> str:
    text = repr(element)
    return text if len(text) <= 60 else text[:57] + "..."


def replica_sizes(global_batch_size: int, num_replicas: int) -> list[int]:
    """Each replica's rows of a full global batch: sizes that differ by at most one, the larger first."""
    base, extra = divmod(global_batch_size, num_replicas)
    return [base + (i < extra) for i in range(num_replicas)]


def batch_shares(global_batch_size: int | None, rows: int, num_replicas: int) -> list[int]:
    """``replica_sizes`` of a batch of ``rows``: a full or partial global batch fills the replicas' shares in
    order; a larger one (an iterable's batches are what they are) is split evenly, no row left out."""
    return replica_sizes(max(global_batch_size or 0, rows), num_replicas)


def rows_for_replica(replica_id: int, sizes: list[int], batch_len: int) -> tuple[int, int]:
    """Replica ``replica_id``'s rows ``[start, stop)`` of a batch of ``batch_len`` rows (a partial one fills in order)."""
    start = min(sum(sizes[:replica_id]), batch_len)
    return start, min(start + sizes[replica_id], batch_len)


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    return map_structure(lambda t: t[start:stop] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, batch)


def split_batch(batch: Any, replica_ids: range, num_replicas: int, global_batch_size: int | None = None) -> Step:
    """The pieces of ``batch`` that belong to ``replica_ids`` (of ``num_replicas``), and its rows. One replica takes an
    unbatched element (a scalar, as ``experimental_make_numpy_dataset`` of a vector yields) as it is, as TF does."""
    if num_replicas == 1 and not _leading_sizes(batch):
        return Step([batch], None)
    length = batch_size_of(batch)
    sizes = batch_shares(global_batch_size, length, num_replicas)
    return cut(batch, [rows_for_replica(r, sizes, length) for r in replica_ids], length)


def cut(batch: Any, spans: list[tuple[int, int]], rows: int | None) -> Step:
    """The pieces ``[start, stop)`` of ``batch``, with its first row as the pad where a piece is empty."""
    pad = slice_batch(batch, 0, 1) if any(start == stop for start, stop in spans) else None
    return Step([slice_batch(batch, start, stop) for start, stop in spans], rows, pad)


def _leading_sizes(batch: Any) -> set[int]:
    """The first dimensions of ``batch``'s tensors (a 0-dim tensor has none)."""
    sizes: set[int] = set()
    map_structure(lambda t: sizes.add(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() > 0 else None, batch)
    return sizes
