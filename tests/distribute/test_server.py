"""A ps task's ``VariableStore`` (async and sync application of pushes) and ``Server``'s task checks."""

from __future__ import annotations

import threading

import pytest
import torch

from launcher.distribute.partitioners import FixedShardsPartitioner
from launcher.distribute.ps_placement import place_module
from launcher.distribute.server import Server, VariableStore
from launcher.strategies.parameter_server import contents_for

CLUSTER = {"chief": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223", "127.0.0.1:2224"], "ps": ["127.0.0.1:2225"]}


def store_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sync: int | None = None, shards: int = 2) -> VariableStore:
    store = VariableStore(0)
    store.create(contents_for(0, model, optimizer, place_module(model, 1, FixedShardsPartitioner(shards))), sync)
    return store


def test_a_server_needs_its_task_when_the_cluster_does_not_decide_it():
    with pytest.raises(ValueError, match="no job_name"):
        Server(CLUSTER, start=False)
    with pytest.raises(ValueError, match="no task_index .* job 'worker', which has 2 tasks"):
        Server(CLUSTER, "worker", start=False)
    with pytest.raises(ValueError, match="no task with index 3"):
        Server(CLUSTER, "worker", 3, start=False)
    assert Server(CLUSTER, "ps", start=False).name == "ps:0"  # one ps task: its index is clear
    assert Server({"ps": ["127.0.0.1:2222"]}, start=False).target == "rpc://127.0.0.1:2222"


def test_async_pushes_are_applied_as_they_arrive_and_only_the_chiefs_count():
    model = torch.nn.Linear(4, 6)
    store = store_of(model, torch.optim.SGD(model.parameters(), lr=0.5))
    before = store.pull(["weight/part_0"])[0]
    grad = torch.ones(3, 4)
    assert store.push("worker:0", {"weight/part_0": grad}, increment=False) == (0, False, 0)
    assert store.push("chief:0", {"weight/part_0": grad}, increment=True) == (1, False, 0)
    torch.testing.assert_close(store.pull(["weight/part_0"])[0], before - 2 * 0.5 * grad)
    assert store.updates == 2


def test_sync_applies_one_mean_step_once_every_task_has_pushed():
    model = torch.nn.Linear(4, 6)
    store = store_of(model, torch.optim.SGD(model.parameters(), lr=1.0), sync=2)
    before = store.pull(["bias/part_1"])[0]
    first = store.push("worker:0", {"bias/part_1": torch.full((3,), 2.0)}, increment=False)
    assert not first.done() and store.updates == 0  # waits for the other task
    second = store.push("chief:0", {"bias/part_1": torch.full((3,), 4.0)}, increment=True)
    assert first.wait() == second.wait() == (1, False, 0)
    torch.testing.assert_close(store.pull(["bias/part_1"])[0], before - 3.0)  # the mean gradient, once


def test_sparse_rows_update_only_those_rows_with_adagrad():
    table = torch.nn.Embedding(10, 3)
    store = store_of(table, torch.optim.Adagrad(table.parameters(), lr=0.1), shards=1)
    before = store.pull(["weight"])[0]
    store.push("chief:0", {"weight": (torch.tensor([2, 7]), torch.ones(2, 3))}, increment=True)
    after = store.pull(["weight"])[0]
    changed = (after != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [2, 7]
    assert store.gather("weight", torch.tensor([7, 2])).shape == (2, 3)


def test_finishing_releases_a_sync_round_and_tells_later_pushes_to_stop():
    model = torch.nn.Linear(2, 2)
    store = store_of(model, torch.optim.SGD(model.parameters(), lr=0.1), sync=2, shards=1)
    waiting = store.push("worker:0", {"bias": torch.ones(2)}, increment=False)
    threading.Timer(0.05, store.finish).start()
    assert waiting.wait() == (0, True, 0)
    assert store.push("worker:1", {"bias": torch.ones(2)}, increment=False) == (0, True, 0)


def test_a_task_that_stops_in_a_sync_job_frees_the_chiefs_push_and_tells_it_to_stop():
    """A worker that stopped on SIGTERM before the chief did: the chief's push returns (its own gradient applied)
    with the signal, so the chief stops and saves too, rather than wait out the sync timeout."""
    model = torch.nn.Linear(2, 2)
    store = store_of(model, torch.optim.SGD(model.parameters(), lr=1.0), sync=2, shards=1)
    before = store.pull(["bias"])[0]
    chiefs = store.push("chief:0", {"bias": torch.full((2,), 4.0)}, increment=True)
    assert not chiefs.done()
    store.leave("worker:0", signum=15)
    assert chiefs.wait() == (1, False, 15)
    torch.testing.assert_close(store.pull(["bias"])[0], before - 4.0)  # the chief's gradient alone
    store.leave("worker:0", signum=15)  # said again (every ps is told, and a finished push adds it too): counted once
    assert store.push("chief:0", {"bias": torch.full((2,), 2.0)}, increment=True).wait() == (2, False, 15)


def test_a_task_that_ends_in_a_sync_job_asks_nobody_to_stop():
    model = torch.nn.Linear(2, 2)
    store = store_of(model, torch.optim.SGD(model.parameters(), lr=1.0), sync=2, shards=1)
    store.leave("worker:0")
    assert store.push("chief:0", {"bias": torch.ones(2)}, increment=True).wait() == (1, False, 0)
