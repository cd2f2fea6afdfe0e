"""Auto-shard policies and shard plans (launcher.input.auto_shard): who reads which files and elements."""

import logging

import pytest
import torch

from launcher import distribute as dl
from launcher.input import auto_shard
from launcher.input.auto_shard import AutoShardPolicy, ShardPlan, TooFewFilesError, resolve_policy, shard_rows

FILE, DATA, OFF, AUTO = AutoShardPolicy.FILE, AutoShardPolicy.DATA, AutoShardPolicy.OFF, AutoShardPolicy.AUTO
SEED_FILES = ["/a/1.tfr", "/a/2.tfr", "/a/3.tfr", "/a/4.tfr"]  # the seeds' TFRecordDataset example


def steps(plan, n, global_batch=4, drop_remainder=False, order=None):
    order = torch.arange(n) if order is None else order
    return [b.tolist() for b in plan.worker_batches(order, global_batch, drop_remainder)]


def test_policy_is_exposed_from_distribute_and_settable_on_input_options():
    assert dl.AutoShardPolicy is AutoShardPolicy
    assert dl.InputOptions().auto_shard_policy is AUTO
    assert dl.InputOptions(auto_shard_policy="file").auto_shard_policy is FILE
    with pytest.raises(ValueError, match="allowed: AUTO, FILE, DATA, OFF"):
        dl.InputOptions(auto_shard_policy="RANDOM")


@pytest.mark.parametrize(
    "policy,files,workers,expected",
    [
        (AUTO, 4, 2, FILE),
        (AUTO, 4, 4, FILE),
        (AUTO, 3, 4, DATA),  # fewer files than workers
        (AUTO, None, 2, DATA),  # not read from files
        (DATA, 4, 2, DATA),
        (OFF, 4, 2, OFF),
        (FILE, 4, 4, FILE),
    ],
)
def test_resolve_policy(policy, files, workers, expected):
    assert resolve_policy(policy, files, workers) is expected


def test_file_with_fewer_files_than_workers_names_data_and_off():
    with pytest.raises(TooFewFilesError) as info:
        resolve_policy(FILE, 3, 4)
    message = str(info.value)
    assert "3 files for 4 workers" in message
    assert "DATA" in message and "OFF" in message


def test_file_on_a_dataset_without_files_is_an_error():
    with pytest.raises(ValueError, match="file-backed"):
        resolve_policy(FILE, None, 2)


def test_seed_files_over_two_workers():
    assert ShardPlan(FILE, 2, 0).files(SEED_FILES) == ["/a/1.tfr", "/a/3.tfr"]
    assert ShardPlan(FILE, 2, 1).files(SEED_FILES) == ["/a/2.tfr", "/a/4.tfr"]


def test_seed_files_over_four_workers_one_each():
    assert [ShardPlan(FILE, 4, i).files(SEED_FILES) for i in range(4)] == [[f] for f in SEED_FILES]


def test_uneven_files_over_two_workers():
    files = [f"f{i}" for i in range(5)]
    assert ShardPlan(FILE, 2, 0).files(files) == ["f0", "f2", "f4"]
    assert ShardPlan(FILE, 2, 1).files(files) == ["f1", "f3"]


def test_data_and_off_read_every_file():
    assert ShardPlan(DATA, 2, 1).files(SEED_FILES) == SEED_FILES
    assert ShardPlan(OFF, 2, 1).files(SEED_FILES) == SEED_FILES


# 10 elements, global batch 4, 2 workers: each worker's rows per step (local batch 2).
def test_partial_last_batch_under_data():
    assert steps(ShardPlan(DATA, 2, 0), 10) == [[0, 2], [4, 6], [8]]
    assert steps(ShardPlan(DATA, 2, 1), 10) == [[1, 3], [5, 7], [9]]


def test_partial_last_batch_under_off():
    assert steps(ShardPlan(OFF, 2, 0), 10) == [[0, 1], [4, 5], [8, 9]]
    assert steps(ShardPlan(OFF, 2, 1), 10) == [[2, 3], [6, 7], []]  # the short global batch leaves worker 1 empty


def test_partial_last_batch_under_file():
    # two files of 5: each worker batches its own 5 rows (indices into what it loaded)
    assert steps(ShardPlan(FILE, 2, 0), 5) == [[0, 1], [2, 3], [4]]


def test_drop_remainder_drops_the_partial_global_batch_everywhere():
    for worker in (0, 1):
        for policy in (DATA, OFF):
            assert len(steps(ShardPlan(policy, 2, worker), 10, drop_remainder=True)) == 2
    # 9 elements: worker 0 keeps 5 under DATA, worker 1 keeps 4, and both still take 2 steps
    assert steps(ShardPlan(DATA, 2, 0), 9, drop_remainder=True) == [[0, 2], [4, 6]]
    assert steps(ShardPlan(DATA, 2, 1), 9, drop_remainder=True) == [[1, 3], [5, 7]]


def test_data_and_off_give_the_same_global_batches_as_one_worker():
    order = torch.randperm(24, generator=torch.Generator().manual_seed(3))
    one = steps(ShardPlan(OFF, 1, 0), 24, 8, order=order)
    for policy in (DATA, OFF):
        per_worker = [steps(ShardPlan(policy, 4, w), 24, 8, order=order) for w in range(4)]
        unions = [sorted(sum((per_worker[w][s] for w in range(4)), [])) for s in range(3)]
        assert unions == [sorted(b) for b in one]


def test_local_batch_must_divide():
    with pytest.raises(ValueError, match="not divisible by 3 workers"):
        ShardPlan(DATA, 3, 0).local_batch_size(8)


def test_a_plan_needs_a_resolved_policy_and_a_valid_worker():
    with pytest.raises(ValueError, match="resolved"):
        ShardPlan(AUTO, 2, 0)
    with pytest.raises(ValueError, match="not in"):
        ShardPlan(FILE, 2, 2)


def test_element_counts():
    counts = [4, 4, 2]
    assert [ShardPlan(FILE, 2, w).element_count(counts) for w in (0, 1)] == [6, 4]
    assert [ShardPlan(DATA, 2, w).element_count([5, 4]) for w in (0, 1)] == [5, 4]
    assert ShardPlan(OFF, 2, 1).element_count(counts) == 10


def test_data_warns_once_per_job(caplog, monkeypatch):
    monkeypatch.setattr(auto_shard, "_warned_data", False)
    with caplog.at_level(logging.WARNING, logger="dlaunch"):
        auto_shard.warn_data_once(4, 2, worker=1)  # the other workers' processes say nothing: worker 0 says it
        auto_shard.warn_data_once(4, 2)
        auto_shard.warn_data_once(4, 2)
    warnings = [r for r in caplog.records if "every one of the 2 workers reads all 4" in r.getMessage()]
    assert len(warnings) == 1


def test_shard_table_for_2x8_lists_16_workers_with_their_nodes():
    names = [f"train-{i:05d}.jsonl" for i in range(40)]
    rows = shard_rows(FILE, names, [100] * 40, nodes=2, devices_per_node=8)
    assert len(rows) == 16
    assert rows[0] == ("0", "0", "train-00000.jsonl, train-00016.jsonl, train-00032.jsonl", "300")
    assert rows[8][:2] == ("8", "1") and rows[15][:2] == ("15", "1")
    assert rows[15][3] == "200"  # 40 files over 16 workers: the last 8 get 2 files


def test_shard_table_collapses_long_file_lists_and_many_workers():
    names = [f"part-{i}" for i in range(320)]
    rows = shard_rows(FILE, names, [1] * 320, nodes=4, devices_per_node=8)
    assert len(rows) == 16 and rows[12] == ("...", "", "17 more workers", "")
    assert rows[0][2] == "part-0, part-32, ..., part-288 (10 files)"
    assert rows[-1][0] == "31"


def test_shard_table_under_data_is_one_row():
    (row,) = shard_rows(DATA, ["a", "b", "c"], [5, 5, 5], nodes=2, devices_per_node=8)
    assert row == ("0-15", "all", "all 3 files; rank r keeps elements k%16==r", "0-1 each")


def test_num_workers_for_a_recipes_own_iterable_is_said_to_do_nothing(caplog):
    """input.num_workers=2 with an IterableDataset: loading stayed in the process (get_worker_info() None), silently."""
    from launcher.input.auto_shard import warn_num_workers_unused

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.ones(2)

    with caplog.at_level(logging.WARNING, logger="dlaunch"):
        warn_num_workers_unused(Stream(), 0)
        assert caplog.text == ""
        warn_num_workers_unused(Stream(), 2)
    assert ("input.num_workers=2 is for a map-style dataset, which dlaunch batches and loads; the training data (Stream) "
            "loads without it (for an IterableDataset: a DataLoader(..., batch_size=None, num_workers=N)") in caplog.text
