"""A recipe's items that cannot be stacked into a batch, explained in the recipe's terms.

``default_collate`` stacks a batch's items field by field; items of different shapes stop it with
``stack expects each tensor to be equal size``, under a dozen of torch's frames and none of the recipe's.
``CheckedCollate`` keeps the collate and, where it fails on such items, says which field, which items and
their shapes, and where the dataset's ``__getitem__`` is.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import default_collate


class UnstackableItems(RuntimeError):
    explained = True  # the message names the field, the items, their shapes and the dataset's __getitem__

    def __init__(self, message: str):
        # A loader worker's failure is raised again in the loading process as this class, with a message of
        # torch's ("Caught ... in DataLoader worker process 0. Original Traceback ..."): keep the explanation.
        marker = f"{type(self).__name__}: "
        super().__init__(message.rpartition(marker)[2].strip() if "Original Traceback" in message else message)


class CheckedCollate:
    """``collate`` (``default_collate`` where None), explaining a failure on items of different shapes.
    A class, not a closure: loader workers started by ``spawn`` or ``forkserver`` receive it pickled."""

    def __init__(self, collate: Callable[[list], Any] | None, dataset: Any):
        self.collate = collate or default_collate
        self.dataset_type = type(dataset)

    def __call__(self, samples: list) -> Any:
        try:
            return self.collate(samples)
        except (RuntimeError, TypeError, ValueError) as exc:
            found = first_difference(samples)
            if found is None:
                raise
            raise UnstackableItems(f"{where_items_come_from(self.dataset_type)} returns items that cannot be stacked into one batch: {found}. "
                                   "Make every item's fields the same shape (pad or cut them), or batch them "
                                   f"yourself (torch said: {exc})") from None


def where_items_come_from(cls: type) -> str:
    """``Name.__getitem__ (file.py:LINE)``, or the dataset's class name where its source is not found."""
    getitem = getattr(cls, "__getitem__", None)
    try:
        path, line = inspect.getsourcefile(getitem), inspect.getsourcelines(getitem)[1]
    except (TypeError, OSError):
        return f"the dataset {cls.__name__}"
    return f"{cls.__name__}.__getitem__ ({Path(path).name}:{line})"


def first_difference(samples: list) -> str | None:
    """'field 0: item 1 is [15], item 0 is [16]' for the first field whose shape or kind differs between items."""
    if len(samples) < 2:
        return None
    fields = [dict(_fields(s)) for s in samples]
    for name, first in fields[0].items():
        for i, other in enumerate(fields[1:], start=1):
            if other.get(name) != first:
                label = f"field {name}: " if name else ""
                return f"{label}item {i} of the batch is {other.get(name, 'missing')}, item 0 is {first}"
    keys = [set(f) for f in fields]
    odd = next((i for i, k in enumerate(keys) if k != keys[0]), None)
    return None if odd is None else f"item {odd} of the batch has the fields {sorted(keys[odd])}, item 0 {sorted(keys[0])}"


def _fields(sample: Any, name: str = "") -> Iterator[tuple[str, str]]:
    """(field name, shape or kind) for each leaf of an item: tuples and lists by position, dicts by key."""
    if isinstance(sample, (tuple, list)) and not _is_number_list(sample):
        for i, value in enumerate(sample):
            yield from _fields(value, f"{name}[{i}]" if name else str(i))
    elif isinstance(sample, dict):
        for key, value in sample.items():
            yield from _fields(value, f"{name}[{key!r}]" if name else repr(key))
    elif isinstance(sample, torch.Tensor) or hasattr(sample, "shape"):
        yield name, f"{list(sample.shape)} ({str(sample.dtype).removeprefix('torch.')})"
    elif _is_number_list(sample):
        yield name, f"a list of {len(sample)} numbers"
    else:
        yield name, type(sample).__name__


def _is_number_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, (int, float)) for v in value)
