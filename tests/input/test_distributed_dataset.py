"""experimental_distribute_dataset and distribute_datasets_from_function (launcher.input.distributed_dataset)."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from launcher import distribute as dl
from launcher.distribute import InputContext, InputOptions, InputReplicationMode, PerReplica


def _values(step):
    """The per-replica components of one step, as lists.

    A TensorDataset batch ``[x]`` comes out as ``[PerReplica(x)]``: a structure of
    per-replica values, as tf.distribute yields.
    """
    if isinstance(step, list):
        (step,) = step
    assert isinstance(step, PerReplica)
    return [v.tolist() for v in step.values]


def test_global_batch_of_8_is_split_4_and_4(strategy):
    (step,) = list(strategy.experimental_distribute_dataset([torch.arange(8)]))
    assert torch.equal(step.values[0], torch.tensor([0, 1, 2, 3]))
    assert torch.equal(step.values[1], torch.tensor([4, 5, 6, 7]))


def test_last_partial_batch_of_6_is_split_4_and_2(strategy):
    steps = list(strategy.experimental_distribute_dataset([torch.arange(8), torch.arange(6)]))
    assert [_values(s) for s in steps] == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1, 2, 3], [4, 5]]]


def test_dataloader_of_14_with_batch_8_gives_two_steps(strategy):
    loader = DataLoader(TensorDataset(torch.arange(14)), batch_size=8, shuffle=False, drop_last=False)
    dist = strategy.experimental_distribute_dataset(loader)
    steps = list(dist)
    assert len(steps) == 2 and len(dist) == 2
    assert _values(steps[0]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _values(steps[1]) == [[8, 9, 10, 11], [12, 13]]


def test_dataloader_whose_only_batch_is_partial_uses_its_batch_size(strategy):
    loader = DataLoader(TensorDataset(torch.arange(6)), batch_size=8)
    (step,) = list(strategy.experimental_distribute_dataset(loader))
    assert _values(step) == [[0, 1, 2, 3], [4, 5]]


def test_dataloader_drop_last_drops_the_partial_batch(strategy):
    loader = DataLoader(TensorDataset(torch.arange(14)), batch_size=8, drop_last=True)
    steps = list(strategy.experimental_distribute_dataset(loader))
    assert [_values(s) for s in steps] == [[[0, 1, 2, 3], [4, 5, 6, 7]]]


def test_dataloader_features_and_labels_stay_aligned(strategy):
    x = torch.arange(14)
    loader = DataLoader(TensorDataset(x, x * 10), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    rows = []
    for step in strategy.experimental_distribute_dataset(loader):
        for feats, labels in strategy.experimental_local_results(step):
            assert torch.equal(labels, feats * 10)
            rows += feats.tolist()
    assert sorted(rows) == list(range(14))


def test_distributed_dataset_can_be_iterated_again(strategy):
    loader = DataLoader(TensorDataset(torch.arange(14)), batch_size=8)
    dist = strategy.experimental_distribute_dataset(loader)
    assert [_values(s) for s in dist] == [_values(s) for s in dist]


def test_tuple_batches_are_split_consistently(strategy):
    x, y = torch.arange(8), torch.arange(8) * 10
    (step,) = list(strategy.experimental_distribute_dataset([(x, y)]))
    xs, ys = step  # a tuple of per-replica values, as tf.distribute yields
    assert xs.values[1].tolist() == [4, 5, 6, 7] and ys.values[1].tolist() == [40, 50, 60, 70]
    (x0, y0), (x1, y1) = strategy.experimental_local_results(step)
    assert x0.tolist() == [0, 1, 2, 3] and y1.tolist() == [40, 50, 60, 70]
    out = strategy.run(lambda a, b: (a + b).sum(), args=step)  # unpacks like TF's run(fn, args=batch)
    assert [int(v) for v in out.values] == [66, 242]


def test_run_unwraps_each_replicas_batch(strategy):
    (step,) = list(strategy.experimental_distribute_dataset([torch.arange(8)]))
    out = strategy.run(lambda t: t.sum(), args=(step,))
    assert out.values == (torch.tensor(6), torch.tensor(22))


def test_per_worker_calls_dataset_fn_once_with_one_pipeline(strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6]), torch.tensor([7, 8])]

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert len(contexts) == 1
    ctx = contexts[0]
    assert isinstance(ctx, InputContext)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 2)
    steps = list(dist)
    assert [_values(s) for s in steps] == [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]  # two batches dequeued a step
    assert len(contexts) == 1  # iterating does not call dataset_fn again


def test_per_worker_dataset_fn_sees_the_per_replica_batch_size(strategy):
    sizes = []

    def dataset_fn(ctx):
        b = ctx.get_per_replica_batch_size(8)
        sizes.append(b)
        data = torch.arange(16)
        return [data[i : i + b] for i in range(0, 16, b)]

    steps = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert sizes == [4]
    assert [_values(s) for s in steps] == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]]]


def test_per_replica_calls_dataset_fn_once_per_replica(strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        base = 100 * ctx.input_pipeline_id
        return [torch.tensor([base + 1]), torch.tensor([base + 2])]

    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    steps = list(strategy.distribute_datasets_from_function(dataset_fn, options))
    assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts] == [(2, 0, 2), (2, 1, 2)]
    assert [_values(s) for s in steps] == [[[1], [101]], [[2], [102]]]  # each replica reads its own dataset


def test_datasets_from_function_on_one_device_yield_plain_batches():
    s = dl.OneDeviceStrategy("cpu:0")
    steps = list(s.distribute_datasets_from_function(lambda ctx: [torch.tensor([ctx.num_replicas_in_sync])]))
    assert len(steps) == 1 and torch.equal(steps[0], torch.tensor([1]))



def test_per_worker_last_step_gives_a_short_replica_an_empty_batch(strategy):
    batches = [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6])]
    steps = list(strategy.distribute_datasets_from_function(lambda ctx: batches))
    assert len(steps) == 2  # the third batch is not dropped
    last = strategy.experimental_local_results(steps[1])
    assert torch.equal(last[0], torch.tensor([5, 6])) and last[1].shape == (0,)


def _ids(step):
    """Each local replica's element ids in one step of a file dataset (dict batches)."""
    return [piece.tolist() for piece in step["id"].values]


def _file_dataset(tmp_path, n=10, shards=2):
    from launcher.input.files import FileDataset, write_shards

    write_shards({"id": torch.arange(n), "x": torch.randn(n, 3)}, tmp_path, shards=shards, fmt="jsonl")
    return FileDataset.from_patterns(str(tmp_path / "*.jsonl"))


def test_file_dataset_in_one_process_splits_each_global_batch_across_thread_replicas(strategy, tmp_path):
    ds = _file_dataset(tmp_path).batch(4, drop_remainder=False)
    steps = [_ids(s) for s in strategy.experimental_distribute_dataset(ds)]
    assert steps == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], []]]


@pytest.mark.parametrize("policy", ["AUTO", "FILE", "DATA", "OFF"])
def test_one_worker_reads_everything_under_every_policy(strategy, tmp_path, policy):
    ds = _file_dataset(tmp_path, n=8).shuffle(seed=1).batch(4)
    dist = strategy.experimental_distribute_dataset(ds, InputOptions(auto_shard_policy=policy))
    rows = sorted(r for s in dist for piece in _ids(s) for r in piece)
    assert rows == list(range(8)) and len(dist) == 2


def test_file_dataset_reshuffles_each_epoch(strategy, tmp_path):
    dist = strategy.experimental_distribute_dataset(_file_dataset(tmp_path, n=32).shuffle(seed=0).batch(32))
    (first,), (second,) = [_ids(s) for s in dist], [_ids(s) for s in dist]
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(32))


def test_file_policy_needs_a_file_backed_dataset(strategy):
    with pytest.raises(ValueError, match="file-backed"):
        strategy.experimental_distribute_dataset([torch.arange(8)], InputOptions(auto_shard_policy=dl.AutoShardPolicy.FILE))


def test_selected_fields_come_out_as_a_tuple_of_per_replica_values(strategy, tmp_path):
    ds = _file_dataset(tmp_path, n=8).batch(8).select("x", "id")
    ((x, ids),) = list(strategy.experimental_distribute_dataset(ds))
    assert [t.shape for t in x.values] == [(4, 3), (4, 3)] and [t.tolist() for t in ids.values] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_element_spec_of_file_datasets_from_a_function_is_not_a_pass(tmp_path):
    """A FileDataset reshuffles at each pass; reading the spec must not count as one (tf.data reads no element)."""
    from launcher.input.files import FileDataset, write_shards

    write_shards({"x": torch.arange(16, dtype=torch.float32).unsqueeze(1)}, tmp_path, 2, "pt")
    make = lambda ctx: FileDataset.from_patterns(str(tmp_path / "*.pt")).shuffle(3).batch(8)  # noqa: E731
    one = dl.OneDeviceStrategy("cpu:0")
    expected = [b["x"] for b in one.distribute_datasets_from_function(make)]
    spec_first = one.distribute_datasets_from_function(make)
    assert spec_first.element_spec is not None
    assert all(torch.equal(a, b["x"]) for a, b in zip(expected, spec_first))


def test_an_uneven_split_is_said_once_in_script_mode_and_never_for_a_recipe(strategy, caplog, monkeypatch):
    """A recipe's step is weighted for a last partial batch (docs/INPUT.md): nothing to say. A script's loss is its
    own: the first batch that splits unevenly is said, once, with the two fixes."""
    from launcher.input import distributed_dataset

    monkeypatch.setattr(distributed_dataset, "_SAID_SHARES", [])
    loader = DataLoader(TensorDataset(torch.arange(100.0)), batch_size=32)
    assert len(list(strategy.experimental_distribute_dataset(loader))) == 4
    assert "splits over" not in caplog.text  # a recipe's run: the default
    strategy.extended.warn_uneven_shares = True
    for _ in range(2):
        list(strategy.experimental_distribute_dataset(loader))
    assert caplog.text.count("a batch of 4 row(s) (global batch 32) splits over the 2 replicas as [4, 0]") == 1
    assert "compute_average_loss(per_example_loss, global_batch_size=32)" in caplog.text and "drop_last=True" in caplog.text
    assert "a loop that gathers its rows (an evaluation's strategy.gather) needs neither" in caplog.text  # no loss there


def _numbered(n):
    for i in range(n):
        yield torch.full((8,), float(i))


@pytest.mark.parametrize("replicas", [1, 2])
def test_reading_element_spec_loses_no_step_of_a_one_shot_source(replicas):
    """The TPU seed reads ``dist_dataset.element_spec`` (a tf.function's input_signature) before its loop. Over a
    generator that read took the first step and the one read ahead: the loop saw [2, 3, 4, 5] of [0..5]."""
    strategy = dl.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    first = lambda x: int(strategy.experimental_local_results(x)[0][0])  # noqa: E731
    ds = strategy.experimental_distribute_dataset(_numbered(6))
    spec = ds.element_spec
    assert str(spec) == str(ds.element_spec)  # read twice: still nothing lost
    assert [first(x) for x in ds] == [0, 1, 2, 3, 4, 5]
    per_replica = strategy.distribute_datasets_from_function(lambda ctx: _numbered(6))
    assert str(per_replica.element_spec) == str(spec)
    assert [first(x) for x in per_replica] == ([0, 1, 2, 3, 4, 5] if replicas == 1 else [0, 2, 4])


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_batch_larger_than_the_first_is_split_whole(replicas):
    """An iterable's batches are what they are: the global batch size was learned from the first (2 rows) and every
    later batch was cut to it, rows 4, 5, 8, 9 never trained, on one device as on two."""
    strategy = dl.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    rows = iter(range(100))
    batches = [torch.tensor([next(rows) for _ in range(n)]) for n in (2, 4, 4, 4)]
    seen, counted = [], []
    steps = iter(strategy.experimental_distribute_dataset(batches))
    for x in steps:
        seen += [int(v) for part in strategy.experimental_local_results(x) for v in part]
        counted.append(steps.rows)
    assert seen == list(range(14)) and counted == [2, 4, 4, 4]


class _GrowingBatches(torch.utils.data.Sampler):
    """A batch sampler whose ``batch_size`` says 2 but whose later batches hold 4 indices."""

    batch_size = 2

    def __iter__(self):
        yield from ([0, 1], [2, 3, 4, 5], [6, 7, 8, 9])

    def __len__(self):
        return 3


def test_a_loaders_batch_larger_than_its_batch_size_is_split_whole():
    strategy = dl.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_sampler=_GrowingBatches())
    steps = iter(strategy.experimental_distribute_dataset(loader))
    got = [[[int(v) for v in part[0]] for part in strategy.experimental_local_results(x)] for x in steps]
    assert got == [[[0], [1]], [[2, 3], [4, 5]], [[6, 7], [8, 9]]]
