"""Which strategy is current, and whether code runs in a replica or cross-replica context.

The state is thread-local, as in TF: ``strategy.scope()`` and replica threads
each push onto their own thread's stack.

* Outside any scope: the default strategy, in its (single) replica context.
* Inside ``with strategy.scope():``: cross-replica context.
* Inside ``strategy.run(fn)``: replica context (one per replica).
* Inside ``merge_call(merge_fn)``: back in cross-replica context.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from launcher.distribute.reduce_op import ReduceOp

if TYPE_CHECKING:
    from launcher.distribute.strategy import Strategy


class _Frame:
    __slots__ = ("strategy", "replica_context")

    def __init__(self, strategy: "Strategy", replica_context: "ReplicaContext | None"):
        self.strategy = strategy
        self.replica_context = replica_context


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Frame] = []
        self.base: "Strategy | None" = None  # set by experimental_set_strategy


_state = _ThreadState()
_default_strategy: "Strategy | None" = None
_default_lock = threading.Lock()


def _get_default_strategy() -> "Strategy":
    global _default_strategy
    with _default_lock:
        if _default_strategy is None:
            from launcher.strategies.impl.default import DefaultStrategy

            _default_strategy = DefaultStrategy()
        return _default_strategy


def _current_frame() -> _Frame | None:
    if _state.stack:
        return _state.stack[-1]
    if _state.base is not None:
        return _Frame(_state.base, None)
    return None


class _enter:
    """``with _enter(strategy, replica_context):`` makes them current on this thread.

    A class rather than a generator context manager: ``strategy.run`` enters one per
    replica per call, and this is its cheapest form.
    """

    __slots__ = ("_frame", "_stack")

    def __init__(self, strategy: "Strategy", replica_context: "ReplicaContext | None"):
        self._frame = _Frame(strategy, replica_context)

    def __enter__(self) -> None:
        self._stack = _state.stack
        self._stack.append(self._frame)

    def __exit__(self, *exc: Any) -> None:
        self._stack.pop()


def get_strategy() -> "Strategy":
    """Return the current strategy: the one in scope, or the default strategy."""
    frame = _current_frame()
    return frame.strategy if frame is not None else _get_default_strategy()


def has_strategy() -> bool:
    """Return True if a non-default strategy is current (in scope or set)."""
    return _current_frame() is not None


def get_replica_context() -> "ReplicaContext | None":
    """The current ``ReplicaContext``, or None in a cross-replica context.

    Outside any scope this is the default strategy's replica context.
    """
    frame = _current_frame()
    if frame is None:
        return ReplicaContext(_get_default_strategy(), 0)
    return frame.replica_context


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` (or ``merge_call``) but outside ``run``."""
    frame = _current_frame()
    return frame is not None and frame.replica_context is None


def experimental_set_strategy(strategy: "Strategy | None") -> None:
    """Make ``strategy`` current without ``with strategy.scope()`` (None resets).

    Equivalent to entering ``strategy.scope()`` for the rest of this thread,
    except that variables are not placed; use ``scope()`` for that.
    """
    if _state.stack:
        raise RuntimeError("experimental_set_strategy cannot be called inside a strategy scope")
    _state.base = strategy


def get_loss_reduction() -> ReduceOp:
    """The ``ReduceOp`` corresponding to the last loss reduction (in this thread).

    ``SUM`` after ``compute_average_loss`` or ``scale_loss`` (TF's convention: a
    loss scaled by the global batch, gradients summed); ``MEAN`` otherwise, which is
    what a replica's plain mean loss is under DDP's averaging::

        loss = compute_average_loss(per_example, global_batch_size=8)
        get_loss_reduction()     # ReduceOp.SUM
    """
    from launcher.distribute.losses import last_loss_reduction

    return last_loss_reduction()


class ReplicaContext:
    """The context of one replica inside ``strategy.run``.

    Example::

        def step(x):
            ctx = get_replica_context()
            total = ctx.all_reduce(ReduceOp.SUM, x)  # same value on every replica
            return total / ctx.num_replicas_in_sync
    """

    def __init__(self, strategy: "Strategy", replica_id_in_sync_group: int, local_id: int = 0):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._local_id = local_id

    @property
    def strategy(self) -> "Strategy":
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id among all replicas in sync, over every worker."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[str, ...]:
        return (self._strategy.extended.worker_devices[self._local_id],)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Reduce ``value`` (a nest of tensors) over all replicas; every replica gets the result."""
        return self._strategy.extended._replica_all_reduce(self._local_id, ReduceOp.from_any(reduce_op), value)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenate ``value`` from all replicas along ``axis``; every replica gets the result."""
        return self._strategy.extended._replica_all_gather(self._local_id, value, axis)

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Arguments from all replicas arrive as ``PerReplica`` values; every replica
        receives ``merge_fn``'s return value.
        """
        return self._strategy.extended._merge_call(self._local_id, merge_fn, args, kwargs or {})

    def __repr__(self) -> str:
        return f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, strategy={type(self._strategy).__name__})"
