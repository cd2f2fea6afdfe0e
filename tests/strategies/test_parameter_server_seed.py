"""parameter_server_strategy.txt's numbers: reduce over every training task and the global step of every worker (processes), local fallback (replica threads)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.multiprocessing as mp

from tests.strategies.ps_cluster import cluster_spec, end_training_task, enter_or_serve, run_cluster


def task(kind: str, index: int, cluster: dict, mode: str, results: mp.Queue) -> None:
    if enter_or_serve(kind, index, cluster):
        return
    from launcher import distribute as dl
    from launcher.distribute import server as ps_server

    strategy = dl.ParameterServerStrategy(mode=mode)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    out = seed_numbers(strategy)  # every task has pushed 3 times once its first reduce returns
    out.update(per_replica_batches(strategy))
    out["step"] = strategy.extended.client.call(0, ps_server.remote_global_step)
    results.put((f"{kind}:{index}", out))
    end_training_task(strategy, kind)


def seed_numbers(strategy) -> dict:
    """The seed's reduce examples: a global batch [0..7] over 2 replicas, and a last batch of 6."""
    v = strategy.run(lambda t: t, args=(next(iter(strategy.experimental_distribute_dataset([torch.arange(8)]))),))
    partial = strategy.run(lambda t: t.float(), args=(next(iter(strategy.experimental_distribute_dataset([torch.arange(6)]))),))
    return {
        "replicas": strategy.num_replicas_in_sync,
        "sum": strategy.reduce("SUM", v, axis=None).tolist(),
        "sum0": int(strategy.reduce("SUM", v, axis=0)),
        "mean_partial": float(strategy.reduce("MEAN", partial, axis=0)),
    }


def per_replica_batches(strategy) -> dict:
    """make_dataset_iterator: "We will assume that the input dataset is batched by the per-replica batch size": each
    replica dequeues whole batches of [0, 1], [2, 3], [4, 5], [6, 7], in turn over all the replicas."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        iterator = strategy.make_dataset_iterator([torch.tensor([2 * i, 2 * i + 1]) for i in range(4)])
    iterator.initialize()
    first = iterator.get_next()
    second = strategy.experimental_run(lambda t: t * 10, iterator)
    iterator.initialize()  # starts over
    again = iterator.get_next()
    return {"first": [t.tolist() for t in strategy.experimental_local_results(first)],
            "second": [t.tolist() for t in strategy.experimental_local_results(second)],
            "sum0_first": int(strategy.reduce("SUM", first, axis=0)),
            "again": [t.tolist() for t in strategy.experimental_local_results(again)]}


def assert_seed_numbers(out: dict) -> None:
    assert out["replicas"] == 2
    assert out["sum"] == [4, 6, 8, 10] and out["sum0"] == 28  # not one replica's [0, 1, 2, 3]
    assert out["mean_partial"] == 2.5  # [0,1,2] and [3,4,5]: the denominator is 6


@pytest.mark.slow
@pytest.mark.parametrize("mode,step", [("async", 6), ("sync", 3)])
def test_reduce_and_global_step_follow_the_seed_on_two_training_tasks(mode, step):
    got, exits = run_cluster(task, cluster_spec(workers=1, ps=1), (mode,))
    assert exits == [0, 0, 0]
    for out in got.values():
        assert_seed_numbers(out)
        assert out["step"] == step  # async: 3 pushes from each of 2 tasks; sync: 3 applied steps
        assert out["sum0_first"] == 6  # 0+1+2+3: each task's replica took a whole batch
    assert (got["chief:0"]["first"], got["chief:0"]["second"], got["chief:0"]["again"]) == ([[0, 1]], [[40, 50]], [[0, 1]])
    assert (got["worker:0"]["first"], got["worker:0"]["second"], got["worker:0"]["again"]) == ([[2, 3]], [[60, 70]], [[2, 3]])


def test_without_a_cluster_it_falls_back_to_one_local_replica(monkeypatch):
    from launcher import distribute as dl

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.warns(UserWarning, match="local training"):
        strategy = dl.ParameterServerStrategy()
    assert strategy.num_replicas_in_sync == 1 and strategy.is_chief
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.module.weight.detach().clone() if hasattr(model, "module") else model.weight.detach().clone()
    strategy.run(lambda x: (model(x).sum().backward(), optimizer.step()), args=(torch.ones(4, 2),))
    after = model.module.weight if hasattr(model, "module") else model.weight
    torch.testing.assert_close(after, before - 0.1 * 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert int(strategy.reduce("SUM", torch.arange(8), axis=0)) == 28


def test_without_a_cluster_num_gpus_per_worker_replicas_run_as_threads(monkeypatch):
    """The seed's local training with 2 "GPUs" (CPU replica threads): its reduce numbers, one device's update, the step."""
    from launcher import distribute as dl

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.warns(UserWarning, match=r"local training on \['cpu:0', 'cpu:1'\], variables on cpu:0"):
        strategy = dl.ParameterServerStrategy(num_gpus_per_worker=2, device="cpu")
    assert strategy.extended.worker_devices == ("cpu:0", "cpu:1")
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    expected = model.weight.detach().clone()
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.arange(16.0).reshape(8, 2)

    def step(batch):
        model(batch).sum().backward()  # each replica's sum over its 4 rows; the replicas' gradients are averaged
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        strategy.run(step, args=(next(iter(strategy.experimental_distribute_dataset([x]))),))
        expected -= 0.1 * x.sum(0) / 2
    torch.testing.assert_close(model.module.weight.detach(), expected.unsqueeze(0).reshape_as(model.module.weight))
    assert strategy.global_step == 3  # the first replica of the one worker: once per applied step
    assert_seed_numbers(seed_numbers(strategy))
    assert per_replica_batches(strategy) == {"first": [[0, 1], [2, 3]], "second": [[40, 50], [60, 70]], "sum0_first": 6,
                                             "again": [[0, 1], [2, 3]]}


def test_num_gpus_per_worker_beyond_the_machines_gpus_is_refused(monkeypatch):
    from launcher import distribute as dl

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"num_gpus_per_worker=99, but this machine has \d+ GPU"):
        dl.ParameterServerStrategy(num_gpus_per_worker=99, device="cuda")
