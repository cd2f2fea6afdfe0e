"""Variable partitioners, as ``tf.distribute.experimental.partitioners``.

Given a variable's shape and dtype a partitioner says how many pieces it is cut into along each
dimension. Only the first dimension is ever cut, so a result looks like ``[n, 1, 1, ...]``.
Where the pieces go is launcher/distribute/ps_placement.py's to decide.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "from_config",
    "num_shards",
    "shard_rows",
]


# --------------------------------------------------------------------------- helpers


def _positive_int(name: str, value: object) -> int:
    """``value`` as an int, or ValueError when it is below 1."""
    number = operator.index(value)  # TypeError for floats, strings, None
    if number < 1:
        raise ValueError(f"{name} must be >= 1, got {number}")
    return number


def _element_size(dtype: object, bytes_per_string: int = 16) -> int:
    """Bytes per element of ``dtype``; ``bytes_per_string`` for a string dtype.

    torch has no string dtype; ``str`` or the name ``"string"`` stands for one,
    so the ``bytes_per_string`` estimate of the TF partitioners keeps a meaning.
    """
    if dtype is str or dtype == "string":
        return bytes_per_string
    return torch.empty((), dtype=dtype).element_size()


def _bytes_per_row(shape: Sequence[int], dtype: object, bytes_per_string: int) -> int:
    """Bytes in one slice of ``shape`` along dim 0 (``shape[0]`` must be > 0)."""
    return math.prod(shape[1:]) * _element_size(dtype, bytes_per_string)


def _unsplit(shape: Sequence[int]) -> list[int]:
    """The "one partition" result for ``shape``: ``[1] * len(shape)``."""
    return [1] * len(shape)


def _ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive integers, without float rounding."""
    return -(-a // b)


def _format_bytes(nbytes: int) -> str:
    """Human-readable size, binary units: ``512 B``, ``1.5 KiB``, ``128.0 MiB``."""
    if nbytes < 1024:
        return f"{nbytes} B"
    size = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


# --------------------------------------------------------------------------- partitioners


class Partitioner:
    """Base class: decides how many shards a variable is cut into.

    Subclasses implement ``__call__(shape, dtype)`` and return the number of
    partitions per dimension, one entry per dimension of ``shape``; only the
    first entry may be above 1.
    """

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        """Partitions per dimension of a variable of ``shape`` and ``dtype``."""
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(shape, dtype)")


class FixedShardsPartitioner(Partitioner):
    """Cuts every variable into ``num_shards`` pieces (fewer if it has fewer rows)."""

    def __init__(self, num_shards: int):
        self.num_shards = _positive_int("num_shards", num_shards)

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        """``[min(num_shards, shape[0]), 1, ...]``; 1 partition for zero rows."""
        result = _unsplit(shape)
        if result:
            result[0] = max(1, min(self.num_shards, shape[0]))
        return result

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self.num_shards})"


class _BySize(Partitioner):
    """Splits dim 0 into shards of a number of rows chosen from the bytes a row holds."""

    max_shards: int | None
    bytes_per_string: int

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        """Partitions per dimension; only dim 0 is split."""
        result = _unsplit(shape)
        if not result or shape[0] == 0:
            return result
        row_bytes = _bytes_per_row(shape, dtype, self.bytes_per_string)
        if row_bytes == 0:
            return result
        shards = _ceil_div(shape[0], self._rows_per_shard(row_bytes))
        result[0] = shards if self.max_shards is None else min(self.max_shards, shards)
        return result

    def _rows_per_shard(self, row_bytes: int) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        size = "min_shard_bytes" if isinstance(self, MinSizePartitioner) else "max_shard_bytes"
        return (f"{type(self).__name__}({size}={getattr(self, size)}, "
                f"max_shards={self.max_shards}, bytes_per_string={self.bytes_per_string})")


class MinSizePartitioner(_BySize):
    """As many shards as ``min_shard_bytes`` allows, capped at ``max_shards``: TF's rounding.

    Rows per shard are ``ceil(min_shard_bytes / row bytes)``, and the shards ``ceil(rows / that)``; the rows are
    then split evenly, so a shard may hold less than ``min_shard_bytes`` (100000 rows of 4 bytes, 256 KiB: 2
    shards of 195 KiB), as ``tf.distribute.experimental.partitioners.MinSizePartitioner`` does.
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        self.min_shard_bytes = _positive_int("min_shard_bytes", min_shard_bytes)
        self.max_shards = _positive_int("max_shards", max_shards)
        self.bytes_per_string = _positive_int("bytes_per_string", bytes_per_string)

    def _rows_per_shard(self, row_bytes: int) -> int:
        return max(1, _ceil_div(self.min_shard_bytes, row_bytes))


class MaxSizePartitioner(_BySize):
    """Keeps every shard at most ``max_shard_bytes``, with as few shards as possible.

    ``max_shards`` (no limit when None) takes precedence: once it is reached,
    shards may grow past ``max_shard_bytes``. A single row larger than
    ``max_shard_bytes`` still makes a shard of its own.
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        self.max_shard_bytes = _positive_int("max_shard_bytes", max_shard_bytes)
        self.max_shards = None if max_shards is None else _positive_int("max_shards", max_shards)
        self.bytes_per_string = _positive_int("bytes_per_string", bytes_per_string)

    def _rows_per_shard(self, row_bytes: int) -> int:
        return max(1, self.max_shard_bytes // row_bytes)


def num_shards(partitioner: Partitioner | None, shape: Sequence[int], dtype: torch.dtype) -> int:
    """How many shards ``partitioner`` cuts a variable into (1 without one).

    Scalars and zero-row variables are never cut. The partitioner's answer is
    checked (one entry per dimension, only dim 0 above 1) and capped at the
    number of rows, so no shard is empty.
    """
    if partitioner is None or len(shape) == 0 or shape[0] == 0:
        return 1
    result = list(partitioner(shape, dtype))
    if len(result) != len(shape):
        raise ValueError(f"{partitioner!r} returned {result} for shape {list(shape)}: need one entry per dimension")
    if any(int(n) != 1 for n in result[1:]) or int(result[0]) < 1:
        raise ValueError(
            f"{partitioner!r} returned {result} for shape {list(shape)}: "
            "only dimension 0 may be partitioned, into at least 1 piece"
        )
    return min(int(result[0]), shape[0])


def shard_rows(rows: int, num_shards: int) -> list[tuple[int, int]]:
    """(offset, length) of each shard along dim 0, as TF splits a partitioned variable.

    The first ``rows % num_shards`` shards get one extra row, e.g. 10 rows in
    3 shards -> ``[(0, 4), (4, 3), (7, 3)]``.
    """
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    num_shards = _positive_int("num_shards", num_shards)
    base, extra = divmod(rows, num_shards)
    spans, offset = [], 0
    for index in range(num_shards):
        length = base + (1 if index < extra else 0)
        spans.append((offset, length))
        offset += length
    return spans


def from_config(
    kind: str | None,
    num_ps: int,
    *,
    num_shards: int | None = None,
    min_shard_bytes: int = 256 << 10,
    max_shard_bytes: int | None = None,
    max_shards: int | None = None,
) -> Partitioner | None:
    """Build a partitioner from the YAML settings.

    ``kind`` None or ``"none"`` -> None (no partitioning); ``"fixed"`` ->
    ``FixedShardsPartitioner(num_shards)``; ``"min_size"`` ->
    ``MinSizePartitioner(min_shard_bytes, max_shards or num_ps)``;
    ``"max_size"`` -> ``MaxSizePartitioner(max_shard_bytes, max_shards)``.
    """
    key = "none" if kind is None else str(kind).strip().lower().replace("-", "_")
    if key in ("none", ""):
        return None
    if key == "fixed":
        if num_shards is None:
            raise ValueError("partitioner 'fixed' needs num_shards")
        return FixedShardsPartitioner(num_shards)
    if key == "min_size":
        return MinSizePartitioner(min_shard_bytes, max_shards or _positive_int("num_ps", num_ps))
    if key == "max_size":
        if max_shard_bytes is None:
            raise ValueError("partitioner 'max_size' needs max_shard_bytes")
        return MaxSizePartitioner(max_shard_bytes, max_shards)
    raise ValueError(f"unknown partitioner kind {kind!r}; use none, fixed, min_size or max_size")
