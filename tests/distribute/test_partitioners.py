"""launcher.distribute.partitioners: TF-style partitioners (the placement they feed: test_ps_placement.py)."""

from __future__ import annotations

import pytest
import torch

from launcher.distribute import partitioners as pt
from launcher.distribute.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)

F32 = torch.float32


# --------------------------------------------------------------------------- TF doc examples


@pytest.mark.parametrize(
    "partitioner, shape, expected",
    [
        (MinSizePartitioner(min_shard_bytes=4, max_shards=2), [6, 1], [2, 1]),
        (MinSizePartitioner(min_shard_bytes=4, max_shards=10), [6, 1], [6, 1]),
        (MaxSizePartitioner(max_shard_bytes=4), [6, 1], [6, 1]),
        (MaxSizePartitioner(max_shard_bytes=4, max_shards=2), [6, 1], [2, 1]),
        (MaxSizePartitioner(max_shard_bytes=1024), [6, 1], [1, 1]),
        (FixedShardsPartitioner(num_shards=2), [10, 3], [2, 1]),
    ],
)
def test_tf_documented_examples(partitioner, shape, expected):
    assert partitioner(shape, F32) == expected


# --------------------------------------------------------------------------- own cases


def test_min_size_embedding_table_is_capped_by_max_shards():
    # 256 bytes per row -> 1024 rows per 256 KiB shard -> 977 shards wanted, 2 allowed.
    assert MinSizePartitioner(256 << 10, max_shards=2)([1_000_000, 64], F32) == [2, 1]


def test_min_size_default_max_shards_is_one():
    assert MinSizePartitioner()([1_000_000, 64], F32) == [1, 1]


def test_min_size_keeps_small_variable_whole():
    # 8 x 64 float32 = 2 KiB < 256 KiB: a single shard even with room for 8.
    assert MinSizePartitioner(256 << 10, max_shards=8)([8, 64], F32) == [1, 1]


def test_min_size_shard_count_follows_min_bytes():
    # 100 rows of 40 bytes, at least 1000 bytes per shard -> 25 rows per shard -> 4 shards.
    assert MinSizePartitioner(1000, max_shards=100)([100, 10], F32) == [4, 1]


def test_min_size_uses_element_size_of_dtype():
    part = MinSizePartitioner(min_shard_bytes=8, max_shards=100)
    assert part([16], torch.float64) == [16]  # 8 bytes per row -> 1 row per shard
    assert part([16], torch.int8) == [2]  # 1 byte per row -> 8 rows per shard


def test_max_size_single_row_over_limit_gets_own_shard():
    # each row is 400 bytes > 100, so one row per shard.
    assert MaxSizePartitioner(max_shard_bytes=100)([5, 100], F32) == [5, 1]


def test_max_size_floor_of_rows_per_shard():
    # 7 bytes allowed, 4 bytes a row -> 1 row per shard (floor), not 2.
    assert MaxSizePartitioner(max_shard_bytes=7)([6, 1], F32) == [6, 1]
    # 12 bytes allowed -> 3 rows per shard -> 2 shards.
    assert MaxSizePartitioner(max_shard_bytes=12)([6, 1], F32) == [2, 1]


def test_fixed_never_exceeds_rows():
    assert FixedShardsPartitioner(num_shards=8)([3, 2, 2], F32) == [3, 1, 1]


def test_string_dtype_uses_bytes_per_string():
    assert MinSizePartitioner(min_shard_bytes=32, max_shards=10, bytes_per_string=8)([8], str) == [2]
    assert MaxSizePartitioner(max_shard_bytes=32, bytes_per_string=16)([8], "string") == [4]


@pytest.mark.parametrize(
    "partitioner",
    [FixedShardsPartitioner(4), MinSizePartitioner(1, max_shards=4), MaxSizePartitioner(1)],
    ids=["fixed", "min", "max"],
)
def test_scalars_and_zero_rows_get_one_partition(partitioner):
    assert partitioner([0, 5], F32) == [1, 1]
    assert all(n == 1 for n in partitioner([], F32))
    assert pt.num_shards(partitioner, (), F32) == 1
    assert pt.num_shards(partitioner, (0, 5), F32) == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: FixedShardsPartitioner(0),
        lambda: MinSizePartitioner(min_shard_bytes=0),
        lambda: MinSizePartitioner(max_shards=0),
        lambda: MinSizePartitioner(bytes_per_string=0),
        lambda: MaxSizePartitioner(max_shard_bytes=0),
        lambda: MaxSizePartitioner(max_shard_bytes=4, max_shards=0),
        lambda: MaxSizePartitioner(max_shard_bytes=4, bytes_per_string=-1),
    ],
    ids=["fixed", "min_bytes", "min_max_shards", "min_string", "max_bytes", "max_max_shards", "max_string"],
)
def test_invalid_arguments_raise_value_error(make):
    with pytest.raises(ValueError, match=">= 1"):
        make()


def test_base_partitioner_is_abstract():
    with pytest.raises(NotImplementedError):
        Partitioner()([4, 4], F32)


def test_num_shards_rejects_split_of_other_dims():
    class Bad(Partitioner):
        def __call__(self, shape, dtype):
            return [1, 2]

    with pytest.raises(ValueError, match="only dimension 0"):
        pt.num_shards(Bad(), (4, 4), F32)


def test_num_shards_caps_at_rows():
    class Greedy(Partitioner):
        def __call__(self, shape, dtype):
            return [100] + [1] * (len(shape) - 1)

    assert pt.num_shards(Greedy(), (3, 4), F32) == 3
    assert pt.num_shards(None, (300, 4), F32) == 1


# --------------------------------------------------------------------------- shard_rows


def test_shard_rows_uneven_split_gives_extra_rows_first():
    assert pt.shard_rows(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert pt.shard_rows(7, 4) == [(0, 2), (2, 2), (4, 2), (6, 1)]


@pytest.mark.parametrize("rows, n", [(1_000_000, 2), (1_000_001, 7), (5, 5), (13, 1)])
def test_shard_rows_cover_every_row_once(rows, n):
    spans = pt.shard_rows(rows, n)
    assert len(spans) == n
    assert sum(length for _, length in spans) == rows
    for (off, length), (next_off, _) in zip(spans, spans[1:]):
        assert off + length == next_off
    assert spans[0][0] == 0
    assert max(s[1] for s in spans) - min(s[1] for s in spans) <= 1


def test_shard_rows_rejects_bad_counts():
    with pytest.raises(ValueError):
        pt.shard_rows(10, 0)
    with pytest.raises(ValueError):
        pt.shard_rows(-1, 2)


# --------------------------------------------------------------------------- from_config


@pytest.mark.parametrize("kind", [None, "none", "None"])
def test_from_config_none(kind):
    assert pt.from_config(kind, num_ps=2) is None


def test_from_config_fixed():
    part = pt.from_config("fixed", num_ps=2, num_shards=3)
    assert isinstance(part, FixedShardsPartitioner)
    assert part([10, 3], F32) == [3, 1]
    with pytest.raises(ValueError, match="num_shards"):
        pt.from_config("fixed", num_ps=2)


def test_from_config_min_size_defaults_max_shards_to_num_ps():
    part = pt.from_config("min_size", num_ps=3)
    assert isinstance(part, MinSizePartitioner)
    assert (part.min_shard_bytes, part.max_shards) == (256 << 10, 3)
    assert part([1_000_000, 64], F32) == [3, 1]
    explicit = pt.from_config("min_size", num_ps=3, min_shard_bytes=4, max_shards=2)
    assert explicit([6, 1], F32) == [2, 1]


def test_from_config_max_size():
    part = pt.from_config("max_size", num_ps=2, max_shard_bytes=4, max_shards=2)
    assert isinstance(part, MaxSizePartitioner)
    assert part([6, 1], F32) == [2, 1]
    uncapped = pt.from_config("max_size", num_ps=2, max_shard_bytes=4)
    assert uncapped.max_shards is None and uncapped([6, 1], F32) == [6, 1]
    with pytest.raises(ValueError, match="max_shard_bytes"):
        pt.from_config("max_size", num_ps=2)


def test_from_config_unknown_kind():
    with pytest.raises(ValueError, match="unknown partitioner kind"):
        pt.from_config("round_robin", num_ps=2)
