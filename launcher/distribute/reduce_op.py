"""``ReduceOp``: how values from several replicas are combined."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """Indicates how a set of values should be reduced.

    * ``SUM``: add the values.
    * ``MEAN``: add the values and divide by their number (with ``axis``, by the
      number of elements along that axis over all replicas).
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_any(cls, op: "ReduceOp | str") -> "ReduceOp":
        if isinstance(op, cls):
            return op
        try:
            return cls[str(op).upper()]
        except KeyError:
            raise ValueError(f"unknown reduce op {op!r}; use ReduceOp.SUM or ReduceOp.MEAN") from None
