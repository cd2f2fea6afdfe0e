"""``RunOptions``: options for ``Strategy.run``.

TF's fields tune how the TPU compiler (XLA) builds the step. torch runs the step
eagerly, so a batch of any size runs as it is: the defaults describe what happens,
and a value that asks for compiler behaviour is refused rather than ignored::

    strategy.run(step_fn, args=(batch,), options=RunOptions(experimental_enable_dynamic_batch_size=True))
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Run options for ``strategy.run``.

    Args:
        experimental_enable_dynamic_batch_size: whether the batch size may change
            between steps (a last partial batch). Eager torch handles any batch
            size, so True and False run the same.
        experimental_bucketizing_dynamic_shape: XLA's padding of dynamic shapes into
            buckets. There is no compiler to pad for: True is a ``ValueError``.
        experimental_xla_options: XLA compiler options. None only: a ``ValueError`` otherwise.
    """

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None

    def __post_init__(self) -> None:
        if self.experimental_bucketizing_dynamic_shape:
            raise ValueError("experimental_bucketizing_dynamic_shape=True pads shapes for the XLA compiler; torch runs "
                             "each step eagerly with the shapes it is given, so there is nothing to bucketize: leave it False")
        if self.experimental_xla_options is not None:
            raise ValueError("experimental_xla_options configure the XLA compiler, which torch does not use: leave it None "
                             "(compile the step yourself with torch.compile if you want a compiler)")


def check(options: Any) -> None:
    """``options`` is None or a ``RunOptions`` (a ``TypeError`` otherwise, not a silent no-op)."""
    if options is not None and not isinstance(options, RunOptions):
        raise TypeError(f"options must be a launcher.distribute.RunOptions, got {type(options).__name__}")
