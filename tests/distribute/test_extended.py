"""StrategyExtended: devices, variable placement and tracking."""

import threading

import pytest
import torch

from launcher import distribute as dl


def test_worker_devices_are_canonical_names(strategy):
    assert strategy.extended.worker_devices == ("cpu:0", "cpu:1")


def test_parameter_devices_default_to_worker_devices(strategy):
    assert strategy.extended.parameter_devices == ("cpu:0", "cpu:1")


def test_num_replicas_in_sync_counts_local_devices(strategy):
    assert strategy.num_replicas_in_sync == 2
    assert strategy.extended.num_replicas_in_sync == 2
    assert strategy.cluster_resolver is None


def test_the_one_process_of_replica_threads_saves_the_summary(strategy):
    """Two replica threads, one process: it writes the shared files (tests/runtime/test_script.py: one of two
    processes does)."""
    assert strategy.extended.should_save_summary is True


def test_module_built_in_scope_is_tracked(strategy):
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    assert all(strategy.extended.variable_created_in_scope(p) for p in model.parameters())


def test_module_built_outside_scope_is_not_tracked(strategy):
    before = torch.nn.Linear(3, 4)
    with strategy.scope():
        pass
    after = torch.nn.Linear(3, 4)
    assert not strategy.extended.variable_created_in_scope(before.weight)
    assert not strategy.extended.variable_created_in_scope(after.weight)


def test_module_built_in_another_strategy_scope_is_not_tracked(strategy):
    other = dl.OneDeviceStrategy("cpu:0")
    with other.scope():
        model = torch.nn.Linear(3, 4)
    assert other.extended.variable_created_in_scope(model.weight)
    assert not strategy.extended.variable_created_in_scope(model.weight)


def test_module_built_on_another_thread_during_scope_is_not_tracked(strategy):
    built = {}
    with strategy.scope():
        t = threading.Thread(target=lambda: built.setdefault("m", torch.nn.Linear(2, 2)))
        t.start()
        t.join()
    assert not strategy.extended.variable_created_in_scope(built["m"].weight)


def test_colocate_vars_with_creates_parameters_on_that_device(strategy):
    anchor = torch.nn.Parameter(torch.zeros(2))
    with strategy.scope(), strategy.extended.colocate_vars_with(anchor):
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.device == anchor.device
    assert strategy.extended.variable_created_in_scope(layer.weight)


def test_duplicate_devices_are_rejected(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="distinct"):
        dl.MirroredStrategy(devices=["cpu:0", "CPU:0"])


def test_cross_device_ops_that_are_not_cross_device_ops_are_rejected(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(TypeError, match="cross_device_ops must be None or a CrossDeviceOps"):
        dl.MirroredStrategy(devices=["cpu:0", "cpu:1"], cross_device_ops=object())


def test_repr_names_devices_and_replicas(strategy):
    assert repr(strategy) == "MirroredStrategy(devices=['cpu:0', 'cpu:1'], num_replicas_in_sync=2)"
