"""OneDeviceStrategy: the same API with one replica; results are plain values."""

import pytest
import torch

from launcher import distribute as dl
from launcher.distribute import PerReplica, ReduceOp, get_replica_context


@pytest.fixture
def strategy():
    return dl.OneDeviceStrategy("cpu:0")


def test_one_replica_and_no_cluster_resolver(strategy):
    assert strategy.num_replicas_in_sync == 1
    assert strategy.cluster_resolver is None
    assert strategy.extended.worker_devices == ("cpu:0",)
    assert strategy.extended.parameter_devices == ("cpu:0",)


def test_device_name_is_canonicalised():
    assert dl.OneDeviceStrategy("CPU:0").extended.worker_devices == ("cpu:0",)


def test_run_returns_plain_values(strategy):
    out = strategy.run(lambda x: x + 1, args=(torch.tensor([1, 2]),))
    assert not isinstance(out, PerReplica)
    assert torch.equal(out, torch.tensor([2, 3]))


def test_run_enters_replica_zero_context(strategy):
    out = strategy.run(lambda: (get_replica_context().replica_id_in_sync_group, dl.get_strategy() is strategy))
    assert out == (0, True)


def test_reduce_along_axis(strategy):
    v = strategy.run(lambda t: t, args=(torch.arange(8),))
    assert torch.equal(strategy.reduce(ReduceOp.SUM, v, axis=0), torch.tensor(28))
    torch.testing.assert_close(strategy.reduce(ReduceOp.MEAN, v, axis=0), torch.tensor(3.5))


def test_reduce_without_axis_is_the_value(strategy):
    v = torch.tensor([4, 6, 8, 10])
    assert torch.equal(strategy.reduce(ReduceOp.SUM, v, axis=None), v)
    assert torch.equal(strategy.reduce(ReduceOp.MEAN, v, axis=None), v)


def test_all_reduce_in_a_single_replica_is_the_identity(strategy):
    out = strategy.run(lambda t: get_replica_context().all_reduce(ReduceOp.SUM, t), args=(torch.tensor([1.0, 2.0]),))
    assert torch.equal(out, torch.tensor([1.0, 2.0]))


def test_distributed_dataset_yields_whole_batches(strategy):
    batches = list(strategy.experimental_distribute_dataset([torch.arange(8), torch.arange(6)]))
    assert len(batches) == 2
    assert torch.equal(batches[0], torch.arange(8))
    assert torch.equal(batches[1], torch.arange(6))


def test_values_from_function_is_a_plain_value(strategy):
    assert strategy.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group) == 0


def test_gather_of_a_plain_value_is_the_value(strategy):
    t = torch.arange(3)
    assert strategy.gather(t, axis=0) is t


def test_prepare_returns_the_module_and_optimizer(strategy):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got_model, got_opt = strategy.prepare(model, opt)
    assert got_model is model and got_opt is opt
    assert strategy.prepare(model) is model
