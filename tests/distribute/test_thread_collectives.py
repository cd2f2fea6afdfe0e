"""Replica threads and their rendezvous (launcher.distribute.collectives): failures and lifetime."""

import gc
import threading
import time
import weakref

import pytest
import torch

from launcher import distribute as dl
from launcher.distribute import ReduceOp, get_replica_context
from launcher.distribute.collectives import _Stop
from tests.conftest import wait_for


def _all_reduce_ones(strategy):
    return strategy.run(lambda: get_replica_context().all_reduce(ReduceOp.SUM, torch.ones(2)))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("failing", [0, 1])
def test_error_in_one_replica_releases_the_other_waiting_in_all_reduce(strategy, failing):
    waiting = threading.Event()

    def fn():
        ctx = get_replica_context()
        if ctx.replica_id_in_sync_group == failing:
            waiting.wait(timeout=5)
            time.sleep(0.05)  # let the other replica block in the barrier
            raise ValueError(f"replica {failing} failed")
        waiting.set()
        return ctx.all_reduce(ReduceOp.SUM, torch.ones(2))

    with pytest.raises(ValueError, match=f"replica {failing} failed"):
        strategy.run(fn)


@pytest.mark.timeout(20)
def test_strategy_still_works_after_a_replica_failed(strategy):
    def fn():
        ctx = get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            raise ValueError("boom")
        return ctx.all_reduce(ReduceOp.SUM, torch.ones(2))

    with pytest.raises(ValueError, match="boom"):
        strategy.run(fn)
    out = _all_reduce_ones(strategy)
    assert all(torch.equal(v, torch.full((2,), 2.0)) for v in out.values)
    assert strategy.run(lambda: get_replica_context().all_gather(torch.ones(1), axis=0)).values[1].shape == (2,)


@pytest.mark.timeout(20)
def test_training_resumes_after_a_failed_step(strategy):
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def step(fail):
        model(torch.ones(2, 3)).sum().backward()
        if fail and get_replica_context().replica_id_in_sync_group == 1:
            raise ValueError("bad batch")
        opt.step()
        opt.zero_grad()

    with pytest.raises(ValueError, match="bad batch"):
        strategy.run(step, args=(True,))
    opt.zero_grad()
    strategy.run(step, args=(False,))
    for a, b in zip(model.replicas[0].parameters(), model.replicas[1].parameters()):
        assert torch.equal(a, b)


@pytest.mark.timeout(20)
def test_errors_in_every_replica_report_a_real_error_not_a_broken_barrier(strategy):
    def fn():
        raise ValueError(f"replica {get_replica_context().replica_id_in_sync_group}")

    with pytest.raises(ValueError, match="replica [01]"):
        strategy.run(fn)


def test_replica_threads_are_created_once(strategy):
    first = strategy.run(lambda: threading.get_ident())
    second = strategy.run(lambda: threading.get_ident())
    assert first.values == second.values


def _fails_on_replica_1():
    if get_replica_context().replica_id_in_sync_group == 1:
        raise ValueError("replica 1 fails")


def _collected(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


@pytest.mark.timeout(20)
@pytest.mark.parametrize("fails", [False, True], ids=["after a run", "after a failed run"])
def test_replica_threads_exit_once_strategy_is_unreachable(monkeypatch, fails):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    s = dl.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    if fails:  # the failure's traceback holds the job's frames: they must not keep the strategy alive
        with pytest.raises(ValueError, match="replica 1 fails"):
            s.run(_fails_on_replica_1)
    else:
        s.run(lambda: None)
    inboxes = list(s.extended._threads._inboxes)  # plain queues: holding them keeps nothing else alive
    idents = {t.ident for t in s.extended._threads._threads}
    strategy_ref = weakref.ref(s)
    del s
    try:
        wait_for(lambda: _collected(strategy_ref), timeout_s=5)  # a replica thread may still be leaving its job's frame
        alive = [t for t in threading.enumerate() if t.ident in idents]
        for t in alive:
            t.join(timeout=2)
        assert not any(t.is_alive() for t in alive)
    finally:  # do not leave the thread for interpreter exit
        for box in inboxes[1:]:
            box.put(_Stop)
        for t in [t for t in threading.enumerate() if t.ident in idents]:
            t.join(timeout=5)
