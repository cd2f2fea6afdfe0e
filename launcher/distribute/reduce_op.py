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
        """A ``ReduceOp``, its name (``"sum"``, ``"MEAN"``), or torch.distributed's ``ReduceOp.SUM`` / ``AVG``."""
        if isinstance(op, cls):
            return op
        name = str(op if isinstance(op, str) else getattr(op, "name", op)).upper()
        try:
            return cls[{"AVG": "MEAN"}.get(name, name)]
        except KeyError:
            raise ValueError(f"unknown reduce op {op!r}; use ReduceOp.SUM or ReduceOp.MEAN "
                             "(launcher.distribute.ReduceOp, or their names)") from None
