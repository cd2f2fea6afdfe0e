"""``InputIterator``: TF1's iterator over a distributed dataset (``make_dataset_iterator``).

TF1 code initializes it, then takes one step of per-replica inputs at a time::

    iterator = strategy.make_dataset_iterator(batches)
    iterator.initialize()
    strategy.experimental_run(replica_fn, iterator)     # one get_next() per call
"""

from __future__ import annotations

from typing import Any, Iterable


class InputIterator:
    """Steps of a distributed dataset, one per ``get_next()``; ``initialize()`` starts it over."""

    def __init__(self, distributed: Iterable):
        self._distributed = distributed
        self._iterator = iter(distributed)

    def initialize(self) -> list:
        """Start from the first step again. Returns TF1's list of initializer ops: empty, nothing to run."""
        self._iterator = iter(self._distributed)
        return []

    def get_next(self) -> Any:
        """The next step's per-replica inputs (``StopIteration`` when the data is over, where TF raises OutOfRangeError)."""
        return next(self._iterator)

    def __iter__(self) -> "InputIterator":
        return self

    def __next__(self) -> Any:
        return self.get_next()
