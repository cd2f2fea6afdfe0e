"""launcher.distribute.partitioners: TF-style partitioners and round-robin ps placement."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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


# --------------------------------------------------------------------------- place


def _small_min_size():
    # 64 bytes minimum: [2, 2] float32 stays whole, [64, 4] float32 is cut in 4.
    return MinSizePartitioner(min_shard_bytes=64, max_shards=4)


def test_round_robin_over_variables_then_shards():
    variables = [
        ("a", (2, 2), F32, True),
        ("b", (3,), F32, True),
        ("c", (2, 2), F32, True),
        ("d", (64, 4), F32, True),
    ]
    placement = pt.place(variables, num_ps=2, partitioner=_small_min_size())
    assert [(s.key, s.ps) for s in placement.shards] == [
        ("a", 0),
        ("b", 1),
        ("c", 0),
        ("d/part_0", 1),
        ("d/part_1", 0),
        ("d/part_2", 1),
        ("d/part_3", 0),
    ]


def test_round_robin_continues_after_a_partitioned_variable():
    variables = [
        ("big", (64, 4), F32, True),
        ("x", (2,), F32, True),
        ("y", (2,), F32, True),
    ]
    placement = pt.place(variables, num_ps=3, partitioner=_small_min_size())
    assert [s.ps for s in placement.of("big")] == [0, 1, 2, 0]
    assert placement.of("x")[0].ps == 1
    assert placement.of("y")[0].ps == 2


def test_shards_carry_offsets_and_shapes():
    placement = pt.place([("t", (10, 3), F32, True)], num_ps=2, partitioner=FixedShardsPartitioner(3))
    shards = placement.of("t")
    assert [(s.index, s.offset, s.shape) for s in shards] == [(0, 0, (4, 3)), (1, 4, (3, 3)), (2, 7, (3, 3))]
    assert all(s.full_shape == (10, 3) and s.num_shards == 3 for s in shards)
    assert sum(s.nbytes for s in shards) == 10 * 3 * 4


def test_non_trainable_variables_stay_whole_but_take_a_turn():
    variables = [
        ("w", (64, 4), F32, True),
        ("stats", (64, 4), F32, False),
        ("b", (4,), F32, True),
    ]
    placement = pt.place(variables, num_ps=2, partitioner=FixedShardsPartitioner(2))
    assert [(s.key, s.ps) for s in placement.shards] == [
        ("w/part_0", 0),
        ("w/part_1", 1),
        ("stats", 0),
        ("b/part_0", 1),
        ("b/part_1", 0),
    ]
    (stats,) = placement.of("stats")
    assert stats.num_shards == 1 and stats.shape == (64, 4) and not stats.trainable


def test_no_partitioner_places_whole_variables():
    variables = [(f"v{i}", (100, 100), F32, True) for i in range(5)]
    placement = pt.place(variables, num_ps=2)
    assert [s.key for s in placement.shards] == ["v0", "v1", "v2", "v3", "v4"]
    assert [s.ps for s in placement.shards] == [0, 1, 0, 1, 0]
    assert placement.bytes_per_ps() == [3 * 40_000, 2 * 40_000]


def test_place_rejects_bad_input():
    with pytest.raises(ValueError, match="num_ps"):
        pt.place([("a", (2,), F32, True)], num_ps=0)
    with pytest.raises(ValueError, match="twice"):
        pt.place([("a", (2,), F32, True), ("a", (3,), F32, True)], num_ps=1)


def test_placement_queries():
    variables = [("a", (2, 2), F32, True), ("d", (64, 4), F32, True), ("s", (), torch.int64, False)]
    placement = pt.place(variables, num_ps=2, partitioner=_small_min_size())
    assert placement.names() == ["a", "d", "s"]
    assert [s.key for s in placement.on(0)] == ["a", "d/part_1", "d/part_3"]
    assert [s.key for s in placement.on(1)] == ["d/part_0", "d/part_2", "s"]
    assert placement.bytes_per_ps() == [16 + 2 * 256, 2 * 256 + 8]
    with pytest.raises(KeyError, match="nope"):
        placement.of("nope")


def test_key_is_bare_name_when_not_partitioned():
    shard = pt.Shard("w", 0, 1, 0, (3,), (3,), F32, ps=0)
    assert shard.key == "w"
    assert shard.nbytes == 12


# --------------------------------------------------------------------------- place_module


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1_000_000, 64)
        self.proj = nn.Linear(64, 8)
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("scratch", torch.zeros(1_000_000, 64), persistent=False)
        self.register_buffer("table", torch.zeros(1_000_000, 64))


def _meta_model():
    with torch.device("meta"):
        return _Model()


def test_place_module_on_meta_device_splits_embedding():
    model = _meta_model()
    assert model.emb.weight.is_meta
    placement = pt.place_module(model, num_ps=2, partitioner=MinSizePartitioner(256 << 10, 2))
    emb = placement.of("emb.weight")
    assert [(s.offset, s.shape, s.ps) for s in emb] == [(0, (500_000, 64), 0), (500_000, (500_000, 64), 1)]
    assert [s.key for s in emb] == ["emb.weight/part_0", "emb.weight/part_1"]


def test_place_module_order_trainability_and_buffers():
    model = _meta_model()
    placement = pt.place_module(model, num_ps=2, partitioner=MinSizePartitioner(256 << 10, 2))
    assert placement.names() == [
        "emb.weight",
        "proj.weight",
        "proj.bias",
        "norm.weight",
        "norm.bias",
        "table",
        "norm.running_mean",
        "norm.running_var",
        "norm.num_batches_tracked",
    ]
    assert "scratch" not in placement.names()  # non-persistent buffer
    (table,) = placement.of("table")  # as big as emb.weight, but a buffer: whole
    assert table.shape == (1_000_000, 64) and not table.trainable
    assert all(s.trainable for s in placement.of("proj.weight"))
    # emb takes ps 0 and 1, then the next seven variables alternate from ps 0.
    assert [placement.of(n)[0].ps for n in placement.names()[1:]] == [0, 1, 0, 1, 0, 1, 0, 1]


def test_place_module_frozen_parameter_is_not_partitioned():
    model = _meta_model()
    model.emb.weight.requires_grad_(False)
    placement = pt.place_module(model, num_ps=2, partitioner=MinSizePartitioner(256 << 10, 2))
    (emb,) = placement.of("emb.weight")
    assert emb.num_shards == 1 and not emb.trainable


def test_rows_table_content():
    model = _meta_model()
    placement = pt.place_module(model, num_ps=2, partitioner=MinSizePartitioner(256 << 10, 2))
    rows = placement.rows()
    assert len(rows) == len(placement.shards)
    # the variable's whole shape beside each shard's rows (the shard's own shape read as the variable's)
    assert rows[0] == ("emb.weight", "[1000000, 64]", "1/2 rows 0-499999", "ps:0", "122.1 MiB")
    assert rows[1] == ("emb.weight", "[1000000, 64]", "2/2 rows 500000-999999", "ps:1", "122.1 MiB")
    assert rows[2] == ("proj.weight", "[8, 64]", "1/1 rows 0-7", "ps:0", "2.0 KiB")
    assert rows[3] == ("proj.bias", "[8]", "1/1 rows 0-7", "ps:1", "32 B")
    assert rows[-1] == ("norm.num_batches_tracked", "[]", "1/1", "ps:1", "8 B")


def test_rows_size_in_mib():
    placement = pt.place([("w", (524_288, 64), F32, True)], num_ps=1)
    assert placement.rows()[0][-1] == "128.0 MiB"


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
