"""Which strategy is current, and cross-replica vs replica context (launcher.distribute.context)."""

import threading

import pytest
import torch

from launcher import distribute as dl
from launcher.distribute import (
    PerReplica,
    ReduceOp,
    ReplicaContext,
    experimental_set_strategy,
    get_loss_reduction,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from launcher.strategies.impl.default import DefaultStrategy


def test_outside_any_scope_the_default_strategy_is_current():
    s = get_strategy()
    assert isinstance(s, DefaultStrategy)
    assert get_strategy() is s
    assert s.num_replicas_in_sync == 1
    assert has_strategy() is False
    assert in_cross_replica_context() is False


def test_outside_any_scope_the_default_replica_context_is_current():
    ctx = get_replica_context()
    assert isinstance(ctx, ReplicaContext)
    assert ctx.strategy is get_strategy()
    assert ctx.replica_id_in_sync_group == 0
    assert ctx.num_replicas_in_sync == 1


def test_inside_scope_the_strategy_is_current_in_cross_replica_context(strategy):
    with strategy.scope():
        assert get_strategy() is strategy
        assert has_strategy() is True
        assert in_cross_replica_context() is True
        assert get_replica_context() is None
    assert isinstance(get_strategy(), DefaultStrategy)
    assert has_strategy() is False


def test_inside_run_each_replica_has_its_own_replica_context(strategy):
    def fn():
        ctx = get_replica_context()
        return (
            ctx.replica_id_in_sync_group,
            ctx.num_replicas_in_sync,
            get_strategy() is strategy,
            has_strategy(),
            in_cross_replica_context(),
            ctx.devices[0],
        )

    with strategy.scope():
        out = strategy.run(fn)
    assert isinstance(out, tuple) and all(isinstance(v, PerReplica) for v in out)
    ids, nums, same, has, cross, devices = (v.values for v in out)
    assert ids == (0, 1)
    assert nums == (2, 2)
    assert same == (True, True)
    assert has == (True, True)
    assert cross == (False, False)
    assert devices == ("cpu:0", "cpu:1")


def test_run_outside_scope_still_enters_replica_context(strategy):
    out = strategy.run(lambda: (get_strategy() is strategy, get_replica_context().replica_id_in_sync_group))
    assert out[0].values == (True, True)
    assert out[1].values == (0, 1)
    assert isinstance(get_strategy(), DefaultStrategy)


def test_replicas_run_on_distinct_threads(strategy):
    out = strategy.run(lambda: threading.get_ident())
    assert out.values[0] == threading.get_ident()  # replica 0 runs on the calling thread
    assert out.values[1] != out.values[0]


def test_merge_call_runs_merge_fn_once_in_cross_replica_context(strategy):
    calls = []

    def merge_fn(s, value, *, tag):
        calls.append((s, in_cross_replica_context(), get_replica_context(), get_strategy(), value, tag))
        return s.reduce(ReduceOp.SUM, value, axis=None)

    def fn(x):
        ctx = get_replica_context()
        return ctx.merge_call(merge_fn, args=(x,), kwargs={"tag": f"r{ctx.replica_id_in_sync_group}"})

    x = PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    with strategy.scope():
        out = strategy.run(fn, args=(x,))
    assert len(calls) == 1
    s, cross, ctx, current, value, tag = calls[0]
    assert s is strategy and current is strategy
    assert cross is True and ctx is None
    assert isinstance(value, PerReplica) and isinstance(tag, PerReplica)
    assert value.values == (torch.tensor(1.0), torch.tensor(2.0))
    assert tag.values == ("r0", "r1")
    # every replica receives merge_fn's return value
    assert torch.equal(out.values[0], torch.tensor(3.0))
    assert torch.equal(out.values[1], torch.tensor(3.0))


def test_merge_call_from_a_single_replica_strategy_runs_in_cross_replica_context():
    s = dl.OneDeviceStrategy("cpu:0")
    out = s.run(lambda: get_replica_context().merge_call(lambda strat, v: (strat is s, in_cross_replica_context(), v), args=(5,)))
    assert out == (True, True, 5)


def test_strategy_still_runs_after_merge_fn_raises(strategy):
    def merge_fn(s):
        raise KeyError("merge failed")

    with pytest.raises((KeyError, RuntimeError)):
        strategy.run(lambda: get_replica_context().merge_call(merge_fn))
    assert strategy.run(lambda: get_replica_context().replica_id_in_sync_group).values == (0, 1)
    out = strategy.run(lambda: get_replica_context().merge_call(lambda s: "ok"))
    assert out.values == ("ok", "ok")


@pytest.mark.timeout(20)
def test_merge_fn_exception_reaches_the_caller_unchanged(strategy):
    class MergeError(Exception):
        pass

    def merge_fn(s):
        raise MergeError("merge failed")

    raised = []
    for _ in range(20):  # the bug is a race that goes wrong almost every time: 20 tries make it certain
        try:
            strategy.run(lambda: get_replica_context().merge_call(merge_fn))
        except Exception as exc:  # noqa: BLE001
            raised.append(type(exc).__name__)
    assert raised == ["MergeError"] * 20


def test_experimental_set_strategy_makes_strategy_current_until_reset(strategy):
    try:
        experimental_set_strategy(strategy)
        assert get_strategy() is strategy
        assert has_strategy() is True
        assert in_cross_replica_context() is True
        assert get_replica_context() is None
    finally:
        experimental_set_strategy(None)
    assert isinstance(get_strategy(), DefaultStrategy)
    assert has_strategy() is False


def test_experimental_set_strategy_inside_scope_raises(strategy):
    with strategy.scope():
        with pytest.raises(RuntimeError):
            experimental_set_strategy(strategy)
    assert has_strategy() is False


def test_entering_a_different_strategy_scope_inside_another_raises(strategy):
    other = dl.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        with pytest.raises(ValueError, match="Mixing different strategies"):
            with other.scope():
                pass
        assert get_strategy() is strategy  # the failed entry left the outer scope intact
    assert has_strategy() is False


def test_entering_a_different_strategy_scope_after_set_strategy_raises(strategy):
    other = dl.OneDeviceStrategy("cpu:0")
    try:
        experimental_set_strategy(strategy)
        with pytest.raises(ValueError, match="Mixing different strategies"):
            with other.scope():
                pass
    finally:
        experimental_set_strategy(None)


def test_reentering_the_same_strategy_scope_is_allowed(strategy):
    with strategy.scope():
        with strategy.scope():
            assert get_strategy() is strategy
        assert in_cross_replica_context() is True


def test_scope_is_thread_local(strategy):
    seen = {}

    def other_thread():
        seen["strategy"] = get_strategy()
        seen["has"] = has_strategy()

    with strategy.scope():
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert isinstance(seen["strategy"], DefaultStrategy)
    assert seen["has"] is False


def test_loss_reduction_is_mean():
    """In a thread no loss was reduced in yet (the state is per thread, and an earlier test in this process may have
    called compute_average_loss on this one)."""
    seen = []
    thread = threading.Thread(target=lambda: seen.append(get_loss_reduction()))
    thread.start()
    thread.join()
    assert seen == [ReduceOp.MEAN]
