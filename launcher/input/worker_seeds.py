"""Loader workers' seeds per rank: where each process loads only its own rows, its workers draw their own.

Every rank's loader has the same generator (the sampler's order must agree across ranks), so DataLoader gave
their workers the same seeds, and rank r's k-th row drew the same random augmentation as rank 0's k-th row.
Where every rank iterates the whole stream and keeps its share, the same draws are right (one global batch, as
one device makes it): only the loaders that read a rank's own rows are reseeded.
"""

from __future__ import annotations

import random
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import get_worker_info


def per_rank(then: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """A ``worker_init_fn`` that reseeds each worker from its base seed, its id and this rank, then calls ``then``.
    Rank 0 (and a single process) keeps DataLoader's own seeding."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return RankSeeded(rank, then) if rank else then


class RankSeeded:
    """Picklable (loader workers may be spawned): torch, random and numpy seeded from (base seed + id, rank)."""

    def __init__(self, rank: int, then: Callable[[int], None] | None):
        self.rank, self.then = rank, then

    def __call__(self, worker_id: int) -> None:
        state = np.random.SeedSequence([get_worker_info().seed % 2**64, self.rank]).generate_state(4, np.uint32)
        seed = int(state[0]) << 32 | int(state[1])
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(state)
        if self.then is not None:
            self.then(worker_id)
