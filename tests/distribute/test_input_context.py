"""InputContext, InputOptions, InputReplicationMode and ValueContext."""

import dataclasses

import pytest
import torch

from launcher import distribute as dl
from launcher.distribute import InputContext, InputOptions, InputReplicationMode, PerReplica, ValueContext


def test_per_replica_batch_size_divides_global_batch():
    assert InputContext(1, 0, 4).get_per_replica_batch_size(64) == 16


def test_per_replica_batch_size_raises_when_not_divisible():
    with pytest.raises(ValueError, match="not divisible"):
        InputContext(1, 0, 4).get_per_replica_batch_size(63)


def test_input_context_properties():
    ctx = InputContext(num_input_pipelines=3, input_pipeline_id=2, num_replicas_in_sync=6)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (3, 2, 6)
    assert "input_pipeline_id=2" in repr(ctx)


def test_input_context_defaults_to_one_pipeline_one_replica():
    ctx = InputContext()
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 1)
    assert ctx.get_per_replica_batch_size(7) == 7


def test_input_options_defaults():
    opts = InputOptions()
    assert opts.experimental_fetch_to_device is True
    assert opts.experimental_replication_mode is InputReplicationMode.PER_WORKER
    assert opts.experimental_place_dataset_on_device is False
    assert opts.experimental_per_replica_buffer_size == 1


def test_input_options_reject_place_on_device_with_fetch_to_device():
    with pytest.raises(ValueError, match="experimental_fetch_to_device"):
        InputOptions(
            experimental_place_dataset_on_device=True,
            experimental_replication_mode=InputReplicationMode.PER_REPLICA,
        )


def test_input_options_reject_place_on_device_per_worker():
    with pytest.raises(ValueError, match="PER_WORKER"):
        InputOptions(experimental_place_dataset_on_device=True, experimental_fetch_to_device=False)


def test_input_options_reject_negative_buffer_size():
    with pytest.raises(ValueError, match="buffer_size"):
        InputOptions(experimental_per_replica_buffer_size=-1)


def test_input_options_accept_place_on_device_per_replica_without_fetch():
    opts = InputOptions(
        experimental_fetch_to_device=False,
        experimental_replication_mode=InputReplicationMode.PER_REPLICA,
        experimental_place_dataset_on_device=True,
    )
    assert opts.experimental_place_dataset_on_device


def test_input_options_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        InputOptions().experimental_fetch_to_device = False  # type: ignore[misc]


def test_value_context_properties_and_defaults():
    assert (ValueContext().replica_id_in_sync_group, ValueContext().num_replicas_in_sync) == (0, 1)
    ctx = ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (1, 2)


def test_distribute_values_from_function_gives_replica_ids_0_and_1(strategy):
    seen = []

    def value_fn(ctx):
        seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
        return torch.tensor([ctx.replica_id_in_sync_group * 10])

    value = strategy.experimental_distribute_values_from_function(value_fn)
    assert isinstance(value, PerReplica)
    assert seen == [(0, 2), (1, 2)]
    assert torch.equal(value.values[0], torch.tensor([0]))
    assert torch.equal(value.values[1], torch.tensor([10]))


def test_distributed_values_feed_run_per_replica(strategy):
    value = strategy.experimental_distribute_values_from_function(lambda ctx: torch.tensor(ctx.replica_id_in_sync_group + 1.0))
    out = strategy.run(lambda v: v * 2, args=(value,))
    assert torch.equal(strategy.reduce(dl.ReduceOp.SUM, out, axis=None), torch.tensor(6.0))
