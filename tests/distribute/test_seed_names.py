"""The seed names that were missing, on replica threads: aliases, RunOptions, element_spec, TF1 methods, TPU start-up."""

from __future__ import annotations

import pytest
import torch

from launcher import distribute as dl
from launcher.distribute.input_context import InputOptions, InputReplicationMode


@pytest.fixture
def strategy():
    from launcher.strategies.mirrored import MirroredStrategy

    return MirroredStrategy(devices=["cpu:0", "cpu:1"])


def test_experimental_run_v2_warns_and_runs(strategy):
    with pytest.warns(DeprecationWarning, match="use strategy.run"):
        out = strategy.experimental_run_v2(lambda x: x * 2, args=(torch.tensor(3),))
    assert [int(v) for v in strategy.experimental_local_results(out)] == [6, 6]


def test_run_options_defaults_run_and_compiler_settings_are_refused(strategy):
    out = strategy.run(lambda: 1, options=dl.RunOptions(experimental_enable_dynamic_batch_size=False))
    assert strategy.experimental_local_results(out) == (1, 1)
    with pytest.raises(ValueError, match="bucketize"):
        dl.RunOptions(experimental_bucketizing_dynamic_shape=True)
    with pytest.raises(ValueError, match="XLA"):
        dl.RunOptions(experimental_xla_options=object())
    with pytest.raises(TypeError, match="RunOptions"):
        strategy.run(lambda: 1, options={"experimental_enable_dynamic_batch_size": True})


def test_element_spec_of_both_distributed_datasets(strategy):
    from launcher.input.delivery import TensorSpec

    batches = [(torch.zeros(8, 3), torch.zeros(8, dtype=torch.int64))] * 2
    spec = strategy.experimental_distribute_dataset(batches).element_spec
    features, labels = spec
    assert features.values == (TensorSpec((None, 3), torch.float32),) * 2
    assert labels.values == (TensorSpec((None,), torch.int64),) * 2

    def dataset_fn(ctx):  # the seed's: from_tensors([[1.]]).repeat().batch(per-replica batch)
        return [torch.ones(ctx.get_per_replica_batch_size(8), 1)] * 3

    ds = strategy.experimental_distribute_datasets_from_function(dataset_fn)
    assert ds.element_spec.values == (TensorSpec((None, 1), torch.float32),) * 2
    assert [tuple(t.shape) for t in strategy.experimental_local_results(next(iter(ds)))] == [(4, 1), (4, 1)]


def test_tf1_methods_warn_and_map_to_torch(strategy):
    with pytest.warns(DeprecationWarning):
        iterator = strategy.make_dataset_iterator([torch.arange(8)])
    assert iterator.initialize() == []
    with pytest.warns(DeprecationWarning):
        v = strategy.experimental_run(lambda t: t, iterator)
    assert strategy.reduce("SUM", v, axis=None).tolist() == [4, 6, 8, 10]
    with pytest.warns(DeprecationWarning):
        it = strategy.make_input_fn_iterator(lambda ctx: [torch.ones(ctx.get_per_replica_batch_size(4), 1)] * 2)
    assert [tuple(t.shape) for t in strategy.experimental_local_results(it.get_next())] == [(2, 1), (2, 1)]
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="PER_WORKER"):
        strategy.make_input_fn_iterator(lambda ctx: [], InputReplicationMode.PER_REPLICA)
    with pytest.warns(DeprecationWarning):
        assert strategy.extended.call_for_each_replica(lambda: 2).values == (2, 2)


def test_options_that_cannot_work_are_refused(strategy):
    with pytest.raises(ValueError, match="only supported in distribute_datasets_from_function"):
        strategy.experimental_distribute_dataset(
            [torch.arange(4)], InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA))
    with pytest.raises(ValueError, match="TensorPipe"):
        dl.Server({"worker": ["127.0.0.1:1"]}, "worker", 0, protocol="grpc", start=False)
    with pytest.raises(ValueError, match="ConfigProto"):
        dl.Server({"worker": ["127.0.0.1:1"]}, "worker", 0, config=object(), start=False)


def test_place_dataset_on_device_per_replica_moves_each_replicas_batches(strategy):
    options = InputOptions(experimental_fetch_to_device=False, experimental_place_dataset_on_device=True,
                           experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    ds = strategy.distribute_datasets_from_function(lambda ctx: [torch.full((2,), ctx.input_pipeline_id)], options)
    assert [t.tolist() for t in strategy.experimental_local_results(next(iter(ds)))] == [[0, 0], [1, 1]]


def test_the_experimental_namespace_and_the_cluster_resolver_base():
    from launcher.cluster.resolvers import SimpleClusterResolver, TFConfigClusterResolver

    assert dl.experimental.CentralStorageStrategy.__name__ == "CentralStorageStrategy"
    assert dl.experimental.ParameterServerStrategy is dl.ParameterServerStrategy
    assert dl.experimental.coordinator.ClusterCoordinator.__name__ == "ClusterCoordinator"
    assert issubclass(SimpleClusterResolver, dl.cluster_resolver.ClusterResolver)
    assert issubclass(TFConfigClusterResolver, dl.cluster_resolver.ClusterResolver)
    with pytest.raises(TypeError):
        dl.cluster_resolver.ClusterResolver()  # abstract: cluster_spec and master


def test_the_tpu_start_up_runs_line_for_line_in_one_process():
    resolver = dl.cluster_resolver.TPUClusterResolver(tpu="")
    dl.tpu.experimental_connect_to_cluster(resolver)
    topology = dl.tpu.initialize_tpu_system(resolver)
    assert topology.mesh_shape == [1, 1, 1, 1] and topology.missing_devices == []
    assignment = dl.tpu.DeviceAssignment.build(topology, computation_shape=[1, 1, 1, 1], num_replicas=1)
    strategy = dl.TPUStrategy(resolver, experimental_device_assignment=assignment)
    assert strategy.cluster_resolver is resolver and strategy.num_replicas_in_sync == 1
    with pytest.raises(ValueError, match="only the local job"):
        dl.cluster_resolver.TPUClusterResolver(tpu="grpc://10.0.0.2:8470")


def test_make_numpy_dataset_gives_the_seeds_rows(strategy):
    import numpy as np

    with pytest.warns(DeprecationWarning):
        dataset = strategy.experimental_make_numpy_dataset(np.ones([10], dtype=np.float32))
    assert len(dataset) == 10 and dataset[0].dtype == torch.float32 and dataset[0].shape == ()
    loader = torch.utils.data.DataLoader(dataset, batch_size=2)  # dataset.batch(2)
    first = next(iter(strategy.experimental_distribute_dataset(loader)))
    assert [t.tolist() for t in strategy.experimental_local_results(first)] == [[1.0], [1.0]]


def test_the_central_storage_seeds_unbatched_numpy_dataset_distributes_on_one_compute_device():
    """central_storage_strategy.txt: `dataset = strategy.experimental_make_numpy_dataset(np.ones([10]))`,
    `strategy.experimental_distribute_dataset(dataset)`, unbatched; on this CPU one compute device takes each
    element whole, as TF gives one replica its dataset's elements."""
    import numpy as np

    strategy = dl.CentralStorageStrategy()
    with pytest.warns(DeprecationWarning):
        dataset = strategy.experimental_make_numpy_dataset(np.ones([10], dtype=np.float32))
    seen = [strategy.experimental_local_results(x) for x in strategy.experimental_distribute_dataset(dataset)]
    assert [tuple(t.tolist() for t in r) for r in seen] == [(1.0,)] * 10


def test_local_results_of_a_parameter_are_each_replicas_copy_once_prepared(strategy):
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
    weight = model.weight
    assert strategy.experimental_local_results(weight) == (weight,)  # one tensor until prepare() copies it
    mirrored = strategy.prepare(model)
    copies = strategy.experimental_local_results(weight)
    assert len(copies) == 2 and copies[0] is weight and copies[1] is not weight
    torch.testing.assert_close(copies[1], weight)
    assert [p is c for p, c in zip(copies, (mirrored.replicas[0].weight, mirrored.replicas[1].weight))] == [True, True]


def seed_names_in_a_process() -> dict:
    """The same seed calls with one replica per process (MirroredStrategy over 2 gloo processes)."""
    import warnings

    from launcher.strategies.mirrored import MirroredStrategy

    s = MirroredStrategy()

    def dataset_fn(input_context):  # the seed's, with global_batch_size = 8
        batch_size = input_context.get_per_replica_batch_size(8)
        return [torch.ones(batch_size, 1) * input_context.input_pipeline_id] * 2

    ds = s.experimental_distribute_datasets_from_function(dataset_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        v = s.experimental_run_v2(lambda t: t, args=(next(iter(s.experimental_distribute_dataset([torch.arange(8)]))),))
    out = {"spec": str(ds.element_spec), "batch": s.experimental_local_results(next(iter(ds)))[0],
           "sum": s.reduce("SUM", v, axis=None), "sum0": s.reduce("SUM", v, axis=0)}
    return out | seed_examples_in_a_process(s)


def seed_examples_in_a_process(s) -> dict:
    """run's and scope's examples, distribute_values_from_function's, and the TF1 input calls, in one process."""
    import numpy as np

    local = lambda value: [getattr(t, "tolist", lambda: t)() for t in s.experimental_local_results(value)]  # noqa: E731
    values = lambda fn: local(s.experimental_distribute_values_from_function(fn))  # noqa: E731
    array_value = np.array([3.0, 2.0, 1.0])
    out = {"constant": values(lambda ctx: torch.tensor(1.0)), "array": values(lambda ctx: array_value[ctx.replica_id_in_sync_group]),
           "count": values(lambda ctx: ctx.num_replicas_in_sync),
           # run's example: value_fn gives num_replicas_in_sync, replica_fn doubles its input
           "run": local(s.run(lambda x: x * 2, args=(s.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync),)))}
    with s.scope():  # scope's example: a variable created in scope, 1.0 on every replica
        variable = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(variable.weight)
        out["in_scope"] = (dl.get_strategy() is s, dl.in_cross_replica_context())
    s.prepare(variable)
    out["variable"] = local(variable.weight)
    out["outside"] = (type(dl.get_strategy()).__name__, dl.has_strategy())
    with pytest.raises(ValueError, match="supports InputReplicationMode.PER_WORKER only"), pytest.warns(DeprecationWarning):
        s.make_input_fn_iterator(lambda ctx: [], InputReplicationMode.PER_REPLICA)
    element = s.experimental_make_numpy_dataset(np.ones([10], dtype=np.float32))[0]
    out["numpy"] = (tuple(element.shape), element.dtype)
    return out


@pytest.mark.slow
def test_the_seed_names_in_processes():
    from launcher.launch.function import run_function

    for rank, r in run_function(seed_names_in_a_process, device="cpu", nproc=2).items():
        assert "TensorSpec(shape=(None, 1), dtype=torch.float32)" in r["spec"]
        assert r["batch"].tolist() == [[float(rank)]] * 4  # per-replica batch 8 / 2, from this worker's pipeline
        assert r["sum"].tolist() == [4, 6, 8, 10] and int(r["sum0"]) == 28
        assert (r["constant"], r["array"], r["count"]) == ([1.0], [[3.0, 2.0][rank]], [2])
        assert r["run"] == [4]  # 2 replicas, doubled
        assert r["in_scope"] == (True, True) and r["variable"] == [[[1.0]]]
        assert r["outside"] == ("DefaultStrategy", False)
        assert r["numpy"] == ((), torch.float32)  # <TensorSliceDataset shapes: (), types: tf.float32>


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"]])
def test_distribute_values_from_function_gives_the_seeds_local_results(devices):
    import numpy as np

    from launcher.strategies.mirrored import MirroredStrategy

    strategy = MirroredStrategy(devices=devices)
    n = len(devices)
    local = lambda fn: strategy.experimental_local_results(strategy.experimental_distribute_values_from_function(fn))  # noqa: E731
    assert [float(v) for v in local(lambda ctx: torch.tensor(1.0))] == [1.0] * n  # 1. a constant
    array_value = np.array([3.0, 2.0, 1.0])
    assert [float(v) for v in local(lambda ctx: array_value[ctx.replica_id_in_sync_group])] == [3.0, 2.0][:n]  # 2.
    assert list(local(lambda ctx: ctx.num_replicas_in_sync)) == [n] * n  # 3. (1,) with one replica
    # run's example: replica_fn doubles what value_fn gave each replica
    doubled = strategy.run(lambda x: x * 2, args=(strategy.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync),))
    assert list(strategy.experimental_local_results(doubled)) == [2 * n] * n


def test_every_public_name_resolves_and_every_strategy_is_public():
    from launcher import strategies

    names = dl.__all__
    assert set(strategies.exports()) <= set(names) and {"FSDPStrategy", "MultiWorkerMirroredStrategy"} <= set(names)
    missing = [n for n in names if not hasattr(dl, n)]
    assert not missing, missing
    star: dict = {}
    exec("from launcher.distribute import *", star)
    assert set(names) <= set(star) and dir(dl) == names
    assert all(hasattr(dl.experimental, n) for n in dl.experimental.__all__)


def test_every_public_strategy_method_has_a_row_in_api_md():
    """MIGRATION.md used strategy.gather, which API.md's tables did not list; prepare, dlaunch's one addition, has
    its own paragraph there."""
    import re

    from tests.conftest import ROOT

    names = [r.split("|")[1] for r in (ROOT / "docs" / "API.md").read_text().splitlines() if r.startswith("| `")]
    missing = [n for n in dir(dl.Strategy) if not n.startswith("_") and n != "prepare"
               and not any(re.search(rf"`(extended\.)?{n}[(`]", row) for row in names)]
    assert not missing, f"docs/API.md has no row for Strategy.{missing}"
