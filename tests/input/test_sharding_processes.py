"""Auto-sharding across two real gloo worker processes: which rank reads what, and no hang on uneven shards."""

from __future__ import annotations

import logging

import pytest
import torch

from launcher.input.files import FileDataset, write_file
from launcher.launch.function import run_function

pytestmark = pytest.mark.slow


def write_ids(directory, sizes):
    """Files with consecutive ids: sizes [4, 4, 2] -> ids 0-3, 4-7, 8-9."""
    start, paths = 0, []
    for i, n in enumerate(sizes):
        ids = torch.arange(start, start + n)
        paths.append(str(write_file(directory / f"part-{i}.jsonl", {"id": ids, "x": ids.float().unsqueeze(1)})))
        start += n
    return paths


def read_steps(files, policy, global_batch, epochs=1, shuffle_seed=None, drop_remainder=True):
    """Each epoch's ids on this rank, with a collective every step (as training has)."""
    from launcher import distribute as dl

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("dlaunch").addHandler(handler)
    strategy = dl.MirroredStrategy()
    ds = FileDataset(tuple(files)).batch(global_batch, drop_remainder)
    ds = ds if shuffle_seed is None else ds.shuffle(shuffle_seed)
    dist = strategy.experimental_distribute_dataset(ds, dl.InputOptions(auto_shard_policy=policy))
    epochs_seen = []
    for _ in range(epochs):
        steps, iterator = [], iter(dist)
        for batch in iterator:
            total = strategy.reduce("SUM", strategy.run(lambda b: b["x"].sum(), args=(batch,)), axis=None)
            (mine,) = strategy.experimental_local_results(batch)  # one replica per process
            steps.append({"ids": mine["id"].tolist(), "global_sum": float(total), "rows": iterator.rows})
        epochs_seen.append(steps)
    return {"epochs": epochs_seen, "own_steps": len(dist), "warnings": [m for m in messages if "FILE shards are uneven" in m]}


def ids(result, epoch=0):
    return [s["ids"] for s in result["epochs"][epoch]]


def test_file_sharding_gives_each_rank_its_own_files(tmp_path):
    files = write_ids(tmp_path, [4, 4, 4, 4])
    results = run_function(read_steps, device="cpu", nproc=2, args=(files, "FILE", 4))
    assert ids(results[0]) == [[0, 1], [2, 3], [8, 9], [10, 11]]  # files 0 and 2
    assert ids(results[1]) == [[4, 5], [6, 7], [12, 13], [14, 15]]  # files 1 and 3
    assert [s["global_sum"] for s in results[0]["epochs"][0]] == [0 + 1 + 4 + 5, 2 + 3 + 6 + 7, 8 + 9 + 12 + 13, 10 + 11 + 14 + 15]
    assert results[0]["warnings"] == results[1]["warnings"] == []


def test_uneven_file_shards_end_together_without_a_hang(tmp_path):
    files = write_ids(tmp_path, [4, 4, 2])  # rank 0 reads files 0 and 2 (6 ids), rank 1 file 1 (4 ids)
    results = run_function(read_steps, device="cpu", nproc=2, args=(files, "FILE", 4, 2), timeout_s=90)
    for epoch in (0, 1):
        assert ids(results[0], epoch) == [[0, 1], [2, 3]]  # its third batch [8, 9] is dropped
        assert ids(results[1], epoch) == [[4, 5], [6, 7]]
    assert (results[0]["own_steps"], results[1]["own_steps"]) == (3, 2)
    # said once, not once per epoch: a long run would print it thousands of times
    assert len(results[0]["warnings"]) == 1 and "dropping this worker's last 1 batch(es)" in results[0]["warnings"][0]
    assert results[1]["warnings"] == []


def test_data_sharding_sees_the_global_batches_of_one_worker(tmp_path):
    files = write_ids(tmp_path, [5, 7])  # DATA: both ranks read both files
    results = run_function(read_steps, device="cpu", nproc=2, args=(files, "DATA", 4, 1, 3))
    one_worker = [b["id"].tolist() for b in FileDataset(tuple(files)).shuffle(3).batch(4)]
    assert len(ids(results[0])) == len(ids(results[1])) == len(one_worker) == 3
    for step, global_batch in enumerate(one_worker):
        assert sorted(ids(results[0])[step] + ids(results[1])[step]) == sorted(global_batch)
        assert ids(results[0])[step] == global_batch[0::2] and ids(results[1])[step] == global_batch[1::2]


def global_rows(files):
    """Each step's global batch rows as the distributed iterator says them, under each policy and for a loader."""
    from torch.utils.data import DataLoader, TensorDataset

    from launcher import distribute as dl
    from launcher.input.position import EpochBatchSampler

    found = {policy: [s["rows"] for s in read_steps(files, policy, 4, drop_remainder=False)["epochs"][0]] for policy in ("FILE", "DATA", "OFF")}
    loader = DataLoader(TensorDataset(torch.arange(7)), batch_sampler=EpochBatchSampler(7, 4, shuffle=False, drop_last=False))
    iterator = iter(dl.MirroredStrategy().experimental_distribute_dataset(loader))
    found["loader"] = [iterator.rows for _ in iterator]
    return found


def test_each_step_says_the_rows_of_its_global_batch(tmp_path):
    files = write_ids(tmp_path, [4, 3])  # 7 rows: global batches of 4 and 3, each rank holding its part
    for found in run_function(global_rows, device="cpu", nproc=2, args=(files,)).values():
        assert found == {"FILE": [4, 3], "DATA": [4, 3], "OFF": [4, 3], "loader": [4, 3]}


def test_auto_falls_back_to_data_with_fewer_files_than_workers(tmp_path):
    files = write_ids(tmp_path, [8])
    results = run_function(read_steps, device="cpu", nproc=2, args=(files, "AUTO", 4))
    assert ids(results[0]) == [[0, 2], [4, 6]] and ids(results[1]) == [[1, 3], [5, 7]]


def input_contexts():
    from launcher import distribute as dl

    strategy = dl.MirroredStrategy()
    seen = []

    def dataset_fn(ctx):
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        b = ctx.get_per_replica_batch_size(4)
        mine = torch.arange(16)[ctx.input_pipeline_id :: ctx.num_input_pipelines]
        return [mine[i : i + b] for i in range(0, len(mine), b)]

    steps = [strategy.experimental_local_results(t)[0].tolist() for t in strategy.distribute_datasets_from_function(dataset_fn)]
    return {"contexts": seen, "steps": steps}


def test_datasets_from_function_per_worker_gets_one_pipeline_per_process():
    results = run_function(input_contexts, device="cpu", nproc=2)
    assert results[0]["contexts"] == [(2, 0, 2)] and results[1]["contexts"] == [(2, 1, 2)]
    assert results[0]["steps"] == [[0, 2], [4, 6], [8, 10], [12, 14]]
    assert results[1]["steps"] == [[1, 3], [5, 7], [9, 11], [13, 15]]


def sampler_loader_both_ways():
    """A torchrun script's loader (a DistributedSampler over the whole dataset) given to each way in."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from launcher import distribute as dl

    strategy = dl.MirroredStrategy()
    data = TensorDataset(torch.arange(16))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    try:
        strategy.experimental_distribute_dataset(loader)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    rows = [strategy.experimental_local_results(b)[0][0].tolist()
            for b in strategy.distribute_datasets_from_function(lambda ctx: loader)]
    return {"refused": refused, "rows": rows}


def test_a_loader_a_distributed_sampler_already_shards_is_refused_not_split_again():
    """Split again, each rank trained on half its share (8 of 16 rows over two ranks) without a word; the loader
    is what distribute_datasets_from_function takes as it is."""
    results = run_function(sampler_loader_both_ways, device="cpu", nproc=2)
    for rank, found in results.items():
        assert "sampler is a DistributedSampler (num_replicas=2)" in found["refused"]
        assert "Drop the DistributedSampler" in found["refused"] and "distribute_datasets_from_function" in found["refused"]
        assert sum(found["rows"], []) == list(range(rank, 16, 2))  # its whole share, once


def whole_dataset_warnings():
    """Three datasets that are no files, each distributed twice: what dlaunch says of each."""
    from torch.utils.data import DataLoader, TensorDataset

    from launcher import distribute as dl
    from launcher.input import auto_shard

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("dlaunch").addHandler(handler)
    strategy = dl.MirroredStrategy()
    said = {}
    for name, make, policy in (("rows", lambda: DataLoader(TensorDataset(torch.arange(8)), batch_size=4), "AUTO"),
                               ("off", lambda: [torch.arange(4)] * 2, "OFF"),
                               ("list", lambda: [torch.arange(4)] * 2, "AUTO")):
        messages.clear()
        for _ in range(2):
            dataset = strategy.experimental_distribute_dataset(make(), dl.InputOptions(auto_shard_policy=policy))
            list(dataset)
        said[name] = list(messages)
    auto_shard._warned_whole = False
    return said


def test_a_dataset_every_worker_iterates_whole_is_said_once_as_tf_warns():
    """tpu_strategy.txt: a dataset not read from files is sharded at the end of its pipeline, so "each worker will do
    redundant work. We will print a warning if this route is selected." A DataLoader over rows reads only each
    worker's rows (nothing to say); OFF asks for every element everywhere."""
    results = run_function(whole_dataset_warnings, device="cpu", nproc=2)
    assert results[0]["rows"] == results[0]["off"] == [] and results[1] == {"rows": [], "off": [], "list": []}
    (said,) = results[0]["list"]  # once, by rank 0, for two distributions
    assert said.startswith("auto_shard_policy AUTO: the dataset (list) is not read from files, so each of the 2 "
                           "workers iterates all of it and keeps its share of every global batch")
    assert "strategy.distribute_datasets_from_function" in said


def read_from(files, policy, global_batch, offset):
    """The steps of a run resumed at ``offset`` of epoch 0: each one's rows on this rank, and its pad's."""
    from launcher import distribute as dl
    from launcher.input.position import Position

    strategy = dl.MirroredStrategy()
    ds = FileDataset(tuple(files)).batch(global_batch, drop_remainder=False)
    dist = strategy.experimental_distribute_dataset(ds, dl.InputOptions(auto_shard_policy=policy))
    dist.set_position(Position(0, offset))
    out, iterator = [], iter(dist)
    for batch in iterator:
        strategy.reduce("SUM", strategy.run(lambda b: b["x"].sum(), args=(batch,)), axis=None)
        (mine,) = strategy.experimental_local_results(batch)
        out.append((mine["id"].tolist(), None if iterator.pad is None else iterator.pad["id"].tolist()))
    return out


@pytest.mark.parametrize("policy", ["DATA", "OFF"])
def test_a_resume_onto_a_step_where_a_worker_has_no_rows_gives_it_a_row_to_pad_with(tmp_path, policy):
    """9 rows, global batch 4, 2 workers: the last step's one row is rank 0's. A resumed run's first step there had
    no earlier batch to step on at weight 0, and the pad was cut from rank 1's empty batch: a NaN loss."""
    files = write_ids(tmp_path, [5, 4])
    results = run_function(read_from, device="cpu", nproc=2, args=(files, policy, 4, 2), timeout_s=90)
    assert results[0] == [([8], None)]
    assert results[1] == [([], [0])]


def first_step_error(files, global_batch):
    from launcher import distribute as dl
    from launcher.input.position import DataStream, NoBatch

    strategy = dl.MirroredStrategy()
    ds = FileDataset(tuple(files)).batch(global_batch)
    stream = DataStream(strategy.experimental_distribute_dataset(ds, dl.InputOptions(auto_shard_policy="FILE")), global_batch)
    try:
        next(stream)
    except NoBatch as exc:
        return str(exc)
    return None


def test_file_shards_that_give_no_step_say_the_shortest_worker_is_why(tmp_path):
    """9 rows in 3 files, global batch 8: NoBatch said "smaller than one global batch (8 rows)", though 9 >= 8."""
    files = write_ids(tmp_path, [3, 3, 3])  # rank 0 reads 6 rows, rank 1 reads 3: fewer than its 4 of a batch
    results = run_function(first_step_error, device="cpu", nproc=2, args=(files, 8), timeout_s=90)
    for rank, held in ((0, 6), (1, 3)):
        assert results[rank].startswith("input.auto_shard_policy=FILE gives each of the 2 workers its own files, and every "
                                        "epoch ends with the shortest worker's: one worker's files fill no batch of its 4 "
                                        f"row(s) of each global batch (this one's hold {held})"), results[rank]


def uneven_from_function():
    from launcher import distribute as dl

    strategy = dl.MirroredStrategy()

    def dataset_fn(ctx):
        n = 3 if ctx.input_pipeline_id == 0 else 2  # rank 0's dataset holds one more batch
        return [torch.ones(2, 1) * (10 * ctx.input_pipeline_id + i) for i in range(n)]

    out, steps = [], iter(strategy.distribute_datasets_from_function(dataset_fn))
    for batch in steps:
        total = strategy.reduce("SUM", strategy.run(lambda b: b.sum(), args=(batch,)), axis=None)
        (mine,) = strategy.experimental_local_results(batch)
        out.append((mine.flatten().tolist(), float(total), steps.rows))
    return out


def test_workers_datasets_of_different_lengths_from_a_function_end_together():
    """Rank 1 left its loop after 2 steps while rank 0 waited in step 3's all-reduce: a hang. As TF's multi-worker
    iterator, the workers agree each step whether any has data; one that ran out steps on an empty batch."""
    results = run_function(uneven_from_function, device="cpu", nproc=2, timeout_s=90)
    assert results[0] == [([0.0, 0.0], 20.0, 4), ([1.0, 1.0], 24.0, 4), ([2.0, 2.0], 4.0, 2)]
    assert results[1] == [([10.0, 10.0], 20.0, 4), ([11.0, 11.0], 24.0, 4), ([], 4.0, 2)]  # rows: every worker's


class _Noisy(torch.utils.data.Dataset):
    """Row i: (i, a random draw made in the loader worker, as an augmentation makes it)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([float(i), float(torch.rand(()))])


def noisy_rows():
    from torch.utils.data import DataLoader

    from launcher import distribute as dl

    strategy = dl.MirroredStrategy()
    loader = DataLoader(_Noisy(), batch_size=4, num_workers=1, generator=torch.Generator().manual_seed(0))
    return [strategy.experimental_local_results(b)[0].tolist() for b in strategy.experimental_distribute_dataset(loader)]


def test_loader_workers_draw_their_own_augmentations_on_each_rank():
    """Every rank's loader has the same generator (the order must agree), so its workers had the same seeds: rank 1's
    k-th row drew what rank 0's k-th row drew. Rank 0 keeps DataLoader's own seeding; the runs repeat exactly."""
    first = run_function(noisy_rows, device="cpu", nproc=2, timeout_s=90)
    again = run_function(noisy_rows, device="cpu", nproc=2, timeout_s=90)
    assert first == again
    ids = [[[row[0] for row in step] for step in first[rank]] for rank in (0, 1)]
    assert ids == [[[0.0, 1.0], [4.0, 5.0]], [[2.0, 3.0], [6.0, 7.0]]]
    draws = [[row[1] for step in first[rank] for row in step] for rank in (0, 1)]
    assert draws[0] != draws[1]
    with_one_process = [[row.tolist() for row in b] for b in torch.utils.data.DataLoader(
        _Noisy(), batch_size=4, num_workers=1, generator=torch.Generator().manual_seed(0))]
    assert draws[0][:2] == [row[1] for row in with_one_process[0][:2]]  # the worker's first draws, as one process's


def uneven_from_function_as_under_nccl():
    """As under nccl, whose group takes no CPU tensor: the flag goes over a gloo group of its own, made at the
    first step (every process's), so that the per-step flag never waits for the GPU."""
    import torch.distributed as dist

    from launcher.distribute import collectives

    collectives.takes_cpu_tensors = lambda group: False  # the default group's backend, as nccl's
    made = []
    real = dist.new_group
    dist.new_group = lambda *a, **kw: made.append(kw.get("backend")) or real(*a, **kw)
    return uneven_from_function(), made


def test_the_per_step_flag_goes_over_a_gloo_group_of_its_own_where_the_job_is_nccl():
    results = run_function(uneven_from_function_as_under_nccl, device="cpu", nproc=2, timeout_s=90)
    for rank in (0, 1):
        steps, made = results[rank]
        assert made == ["gloo"] and len(steps) == 3


def spec_on_rank_0_then_uneven():
    import torch.distributed as dist

    from launcher import distribute as dl

    strategy = dl.MirroredStrategy()
    ds = strategy.distribute_datasets_from_function(
        lambda ctx: [torch.ones(2, 1) * i for i in range(3 if ctx.input_pipeline_id == 0 else 2)])
    spec = str(ds.element_spec) if dist.get_rank() == 0 else None  # one rank alone reads it
    return spec, [strategy.experimental_local_results(b)[0].flatten().tolist() for b in ds]


def test_element_spec_read_on_one_rank_alone_runs_no_collective():
    """The per-step agreement ran while element_spec read a step, on rank 0 alone: a hang."""
    results = run_function(spec_on_rank_0_then_uneven, device="cpu", nproc=2, timeout_s=90)
    assert "TensorSpec(shape=(None, 1), dtype=torch.float32)" in results[0][0]
    assert results[0][1] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]] and results[1][1] == [[0.0, 0.0], [1.0, 1.0], []]
