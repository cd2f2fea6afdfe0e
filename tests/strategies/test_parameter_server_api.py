"""ParameterServerStrategy and Server from Python, as tf.distribute users write them (TF_CONFIG per task)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from launcher.cluster.resolvers import ClusterSpec, SimpleClusterResolver
from launcher.distribute.meta_scope import variables_scope
from launcher.distribute.ps_placement import place_module
from launcher.strategies.parameter_server import ParameterServerStrategy, PSModule
from tests.strategies.ps_cluster import cluster_spec, end_training_task, enter_or_serve, run_cluster


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 100, (8, 2), generator=g), torch.randn(8, 1, generator=g)) for _ in range(5)]


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Flatten(), torch.nn.Linear(16, 1))


def task(kind: str, index: int, cluster: dict, results: mp.Queue) -> None:
    """One task with its own TF_CONFIG: ps tasks join a Server; the chief and the worker train in sync."""
    if enter_or_serve(kind, index, cluster):
        return
    from launcher import distribute as dl
    strategy = dl.ParameterServerStrategy(variable_partitioner=dl.FixedShardsPartitioner(2), mode="sync")
    model = new_model()  # built outside scope(): the chief's values initialize the variables
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    mine = slice(0, 4) if kind == "chief" else slice(4, 8)
    for x, y in data():
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    # plain lists: a tensor put on a torch.multiprocessing queue is shared through a file descriptor that the
    # parent fetches from this process, which may have exited by then (connection reset)
    values = {k: v.tolist() for k, v in model.state_dict_from_ps().items()} if kind == "chief" else None
    results.put((f"{kind}:{index}", (values, strategy.global_step)))
    end_training_task(strategy, kind)


@pytest.mark.slow
def test_servers_by_hand_and_sync_training_equal_one_device():
    got, exits = run_cluster(task, cluster_spec(workers=1, ps=2))
    assert exits == [0, 0, 0, 0]
    values, step = got["chief:0"]
    assert step == got["worker:0"][1] == 5  # sync: one global step per applied step, however many tasks push

    model = new_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data():
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(torch.tensor(values[name], dtype=value.dtype), value, rtol=1e-5, atol=1e-6, msg=name)


def colocating_task(kind: str, index: int, cluster: dict, results: mp.Queue) -> None:
    """The chief colocates a layer's variables with another's weight, then trains two steps."""
    if enter_or_serve(kind, index, cluster):
        return
    from launcher import distribute as dl
    strategy = dl.ParameterServerStrategy()
    model = colocated_model(strategy)
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in data()[:2]:
        torch.nn.functional.mse_loss(model(x.float()), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    held = {k: [s.key for s in strategy.extended.client.placement.on(k)] for k in range(2)}
    results.put((f"{kind}:{index}", (held, {k: v.tolist() for k, v in model.state_dict_from_ps().items()})))
    end_training_task(strategy, kind)


def colocated_model(strategy) -> torch.nn.Module:
    torch.manual_seed(0)
    first = torch.nn.Linear(2, 2)
    with strategy.extended.colocate_vars_with(first.weight):
        second = torch.nn.Linear(2, 2)
    return torch.nn.Sequential(first, second, torch.nn.Linear(2, 1))


@pytest.mark.slow
def test_colocated_variables_live_on_their_anchors_ps_task_and_train():
    """The seed: "For colocating variables, use strategy.extended.colocate_vars_with". Placement was round-robin
    whatever the scope said (1.bias on ps 1)."""
    got, exits = run_cluster(colocating_task, cluster_spec(workers=0, ps=2))
    assert exits == [0, 0, 0]
    held, values = got["chief:0"]
    assert held == {0: ["0.weight", "2.weight", "1.weight", "1.bias"], 1: ["0.bias", "2.bias"]}
    from launcher import distribute as dl

    model = colocated_model(dl.get_strategy())  # the default strategy: one process, the same values
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data()[:2]:
        torch.nn.functional.mse_loss(model(x.float()), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(torch.tensor(values[name]), value, rtol=1e-5, atol=1e-6, msg=name)


def unprepared_task(kind: str, index: int, cluster: dict, results: mp.Queue) -> None:
    """A chief and a worker that end without ever calling prepare (nothing to train)."""
    if enter_or_serve(kind, index, cluster):
        return
    from launcher import distribute as dl
    strategy = dl.ParameterServerStrategy()
    results.put((f"{kind}:{index}", strategy.num_replicas_in_sync))
    end_training_task(strategy, kind)


@pytest.mark.slow
def test_tasks_that_never_prepare_end_cleanly():
    """A worker's leave() needed prepare()'s client: an AttributeError, then an abort in the RPC agent at exit."""
    got, exits = run_cluster(unprepared_task, cluster_spec(workers=1, ps=1))
    assert got == {"chief:0": 2, "worker:0": 2} and exits == [0, 0, 0]


def test_a_cluster_without_this_tasks_type_or_id_is_a_value_error(monkeypatch):
    cluster = ClusterSpec({"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]})
    with pytest.raises(ValueError, match="task_type or task_id is not"):
        ParameterServerStrategy(SimpleClusterResolver(cluster))
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster.as_dict()}))
    with pytest.raises(ValueError, match="task_type or task_id is not"):
        ParameterServerStrategy()
    with pytest.raises(ValueError, match="no ps job"):
        ParameterServerStrategy(SimpleClusterResolver(ClusterSpec({"chief": ["127.0.0.1:1"]}), task_type="chief", task_id=0))
    with pytest.raises(ValueError, match="Server"):
        ParameterServerStrategy(SimpleClusterResolver(cluster, task_type="ps", task_id=0))
    monkeypatch.delenv("TF_CONFIG")
    with pytest.warns(UserWarning, match="local training"):  # no cluster: the seed's local fallback
        assert ParameterServerStrategy().num_replicas_in_sync == 1


def test_modules_built_in_scope_have_no_values_but_the_data_does():
    with variables_scope():
        table = torch.nn.Embedding(1_000_000, 64)
        norm = torch.nn.BatchNorm1d(4)
        batch = torch.randn(3, 4)
    assert table.weight.is_meta and norm.running_mean.is_meta
    assert not batch.is_meta


def test_a_chiefs_model_built_in_scope_is_refused_by_prepare_where_no_ps_task_builds_it():
    """From Python (ps tasks in Server.join()), a chief's model built in scope() has shapes only: prepare waited out
    ready_timeout_s for values that nobody would send, with no word. Under dlaunch (open_on_prepare=False) the ps
    tasks build the recipe's model themselves, and a meta model is what the chief prepares."""
    from launcher.strategies.impl.parameter_server import _PSExtended

    extended = _PSExtended.__new__(_PSExtended)  # its prepare's check, before any RPC: no cluster needed
    extended._args = {"task": "chief:0", "open_on_prepare": True}
    with variables_scope():
        model = new_model()
    with pytest.raises(ValueError, match="the chief's model is on the meta device .* build the model outside scope"):
        extended._prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


class CountingClient:
    """Stands in for the RPC client: serves a real table and counts the rows asked for."""

    def __init__(self, module: torch.nn.Module, placement):
        self.placement, self.values, self.rows = placement, dict(module.named_parameters()), []

    def pull(self, names):
        return {n: self.values[n].detach().clone() for n in names}

    def gather(self, name, ids):
        self.rows.append(ids.clone())
        return self.values[name].detach()[ids]


def test_an_embedding_lookup_pulls_only_its_rows_and_pushes_their_gradients():
    real = torch.nn.Sequential(torch.nn.Embedding(1000, 4), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    with variables_scope():
        meta = torch.nn.Sequential(torch.nn.Embedding(1000, 4), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    placement = place_module(meta, 2)
    client = CountingClient(real, placement)
    ps_model = PSModule(meta, client, torch.device("cpu"))
    ids = torch.tensor([[5, 900], [5, 7]])
    out = ps_model(ids)
    torch.testing.assert_close(out, real(ids))
    assert client.rows[0].tolist() == [5, 7, 900]  # each needed row once, never the table
    out.sum().backward()
    grads = ps_model.gradients()
    rows, values = grads[placement.of("0.weight")[0].ps]["0.weight"]
    out_real = real(ids)
    out_real.sum().backward()
    assert rows.tolist() == [5, 7, 900]
    torch.testing.assert_close(values, real[0].weight.grad[[5, 7, 900]])
    torch.testing.assert_close(grads[placement.of("2.weight")[0].ps]["2.weight"], real[2].weight.grad)


def test_num_gpus_per_worker_given_first_as_tf1s_contrib_strategy_took_it_says_to_pass_it_by_keyword():
    """``ParameterServerStrategy(0)`` read the 0 as a resolver: ``'int' object has no attribute 'cluster_spec'``."""
    with pytest.raises(TypeError, match=r"pass num_gpus_per_worker=0 by keyword"):
        ParameterServerStrategy(0)
