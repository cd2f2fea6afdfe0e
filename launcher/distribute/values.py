"""Per-replica values and the small amount of tree plumbing they need.

A ``PerReplica`` holds one component per *local* replica, like
``tf.distribute.DistributedValues``. Strategies with a single replica in sync
hand back plain values instead, as TF does.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


class PerReplica:
    """One value per local replica, in replica order."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[Any]):
        self.values = tuple(values)

    def __repr__(self) -> str:
        inner = ",\n  ".join(f"{i}: {v!r}" for i, v in enumerate(self.values))
        return f"PerReplica({{\n  {inner}\n}})"

    def __len__(self) -> int:  # number of local components
        return len(self.values)


def _is_leaf(value: Any) -> bool:
    return isinstance(value, (PerReplica, torch.Size))


def map_structure(fn: Callable[..., Any], *trees: Any) -> Any:
    """Apply ``fn`` leaf-wise over matching nests of tuples, lists and dicts."""
    first = trees[0]
    if _is_leaf(first):
        return fn(*trees)
    if isinstance(first, dict):
        return type(first)((k, map_structure(fn, *(t[k] for t in trees))) for k in first)
    if isinstance(first, (list, tuple)):
        mapped = [map_structure(fn, *parts) for parts in zip(*trees)]
        if hasattr(first, "_fields"):  # namedtuple
            return type(first)(*mapped)
        return type(first)(mapped)
    return fn(*trees)


def select_replica(index: int, tree: Any) -> Any:
    """Replace every ``PerReplica`` in ``tree`` by its ``index``-th component."""

    def pick(leaf: Any) -> Any:
        return leaf.values[index] if isinstance(leaf, PerReplica) else leaf

    if isinstance(tree, PerReplica):
        return tree.values[index]
    return map_structure(pick, tree)


def regroup(outputs: Sequence[Any]) -> Any:
    """Turn a list of per-replica structures into a structure of ``PerReplica``.

    ``[(a0, b0), (a1, b1)]`` becomes ``(PerReplica(a0, a1), PerReplica(b0, b1))``.
    """
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, dict) and all(isinstance(o, dict) and o.keys() == first.keys() for o in outputs):
        return type(first)((k, regroup([o[k] for o in outputs])) for k in first)
    if isinstance(first, (list, tuple)) and not _is_leaf(first) and all(
        type(o) is type(first) and len(o) == len(first) for o in outputs
    ):
        parts = [regroup(list(group)) for group in zip(*outputs)]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    return PerReplica(outputs)


def contains_per_replica(tree: Any) -> bool:
    found = False

    def visit(leaf: Any) -> None:
        nonlocal found
        found = found or isinstance(leaf, PerReplica)

    if isinstance(tree, PerReplica):
        return True
    map_structure(visit, tree)
    return found
