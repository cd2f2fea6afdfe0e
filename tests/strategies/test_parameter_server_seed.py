"""parameter_server_strategy.txt's numbers: reduce over every training task, the global step of every worker, local fallback."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.multiprocessing as mp

from tests.strategies.ps_cluster import cluster_spec, end_training_task, enter_task, run_cluster


def task(kind: str, index: int, cluster: dict, mode: str, results: mp.Queue) -> None:
    enter_task(kind, index, cluster)
    from launcher import distribute as dl
    from launcher.cluster import rpc
    from launcher.distribute import server as ps_server

    if kind == "ps":
        dl.Server(cluster, "ps", index).join()
        rpc.shutdown()
        return
    strategy = dl.ParameterServerStrategy(mode=mode)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    v = strategy.run(lambda t: t, args=(next(iter(strategy.experimental_distribute_dataset([torch.arange(8)]))),))
    partial = strategy.run(lambda t: t.float(), args=(next(iter(strategy.experimental_distribute_dataset([torch.arange(6)]))),))
    out = {
        "replicas": strategy.num_replicas_in_sync,
        "sum": strategy.reduce(dl.ReduceOp.SUM, v, axis=None).tolist(),  # every task has pushed 3 times once this returns
        "sum0": int(strategy.reduce("SUM", v, axis=0)),
        "mean_partial": float(strategy.reduce("MEAN", partial, axis=0)),
        "step": strategy.extended.client.call(0, ps_server.remote_global_step),
    }
    results.put((f"{kind}:{index}", out))
    end_training_task(strategy, kind)


@pytest.mark.slow
@pytest.mark.parametrize("mode,step", [("async", 6), ("sync", 3)])
def test_reduce_and_global_step_follow_the_seed_on_two_training_tasks(mode, step):
    got, exits = run_cluster(task, cluster_spec(workers=1, ps=1), (mode,))
    assert exits == [0, 0, 0]
    for out in got.values():
        assert out["replicas"] == 2
        assert out["sum"] == [4, 6, 8, 10] and out["sum0"] == 28  # not one task's [0, 1, 2, 3]
        assert out["mean_partial"] == 2.5  # [0,1,2] and [3,4,5]: the denominator is 6
        assert out["step"] == step  # async: 3 pushes from each of 2 tasks; sync: 3 applied steps


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
