"""launcher.distribute.ps_placement: round-robin ps placement, partitioned and colocated variables."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from launcher.distribute import ps_placement as pt
from launcher.distribute.partitioners import FixedShardsPartitioner, MinSizePartitioner

F32 = torch.float32


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


# --------------------------------------------------------------------------- colocate_vars_with


def test_a_colocated_variable_goes_whole_to_its_anchors_ps_and_takes_no_turn():
    variables = [("a", (8,), F32, True), ("b", (8,), F32, True, "a"), ("c", (8,), F32, True), ("d", (8,), F32, True)]
    placement = pt.place(variables, num_ps=3)
    assert [(s.name, s.ps) for s in placement.shards] == [("a", 0), ("c", 1), ("d", 2), ("b", 0)]


def test_a_colocated_variable_is_not_partitioned_and_a_chain_ends_at_a_placed_variable():
    variables = [("emb", (10, 3), F32, True), ("x", (10, 3), F32, True, "y"), ("y", (4,), F32, True, "emb"),
                 ("z", (1,), F32, True)]
    placement = pt.place(variables, num_ps=2, partitioner=FixedShardsPartitioner(2))
    assert [(s.key, s.ps) for s in placement.shards] == [("emb/part_0", 0), ("emb/part_1", 1), ("z", 0), ("x", 0), ("y", 0)]


def test_colocating_with_a_variable_that_is_not_placed_is_a_value_error():
    with pytest.raises(ValueError, match="'b' is colocated with 'nope', which is not one of the variables placed"):
        pt.place([("a", (2,), F32, True), ("b", (2,), F32, True, "nope")], num_ps=2)


def test_place_module_follows_the_strategys_colocate_vars_with():
    """The seed's "For colocating variables, use strategy.extended.colocate_vars_with": modules built in it go
    where the anchor goes, here ps 0, and round-robin goes on as if they were not there."""
    from launcher import distribute as dl

    strategy = dl.OneDeviceStrategy("cpu:0")
    first = nn.Linear(2, 2)
    with strategy.extended.colocate_vars_with(first.weight):
        second = nn.Linear(2, 2)
    model = nn.Sequential(first, second, nn.Linear(2, 1))
    placement = pt.place_module(model, num_ps=2)
    assert [(s.name, s.ps) for s in placement.shards] == [
        ("0.weight", 0), ("0.bias", 1), ("2.weight", 0), ("2.bias", 1), ("1.weight", 0), ("1.bias", 0)]


def test_place_module_refuses_a_colocation_anchor_outside_the_model():
    from launcher import distribute as dl

    stray = nn.Linear(3, 3)
    with dl.OneDeviceStrategy("cpu:0").extended.colocate_vars_with(stray.weight):
        inner = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"'weight' was created in colocate_vars_with\(\) of a tensor of shape \[3, 3\] "
                                         "that is not a variable of this model"):
        pt.place_module(inner, num_ps=2)


def test_a_recipes_build_colocates_alike_with_and_without_a_strategy(tmp_path):
    """ctx.colocate_vars_with: the chief builds with a strategy, a ps job's plan and ps tasks with None; the
    placements must agree, or the chief pulls a variable from a ps task that does not hold it."""
    from launcher import distribute as dl
    from launcher.distribute.meta_scope import variables_scope
    from launcher.runtime.recipe import BuildContext

    def build(ctx):
        first = nn.Linear(2, 2)
        with ctx.colocate_vars_with(first.bias):
            second = nn.Linear(2, 2)
        return nn.Sequential(first, second, nn.Linear(2, 1))

    def ctx(strategy):
        return BuildContext(strategy=strategy, seed=0, global_batch_size=4, per_replica_batch_size=4,
                            num_replicas_in_sync=1, run_dir=tmp_path, is_chief=True)

    strategy = dl.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        chiefs = build(ctx(strategy))
    with variables_scope():
        planned = build(ctx(None))
    rows = [[(s.name, s.ps) for s in pt.place_module(m, num_ps=3).shards] for m in (chiefs, planned)]
    assert rows[0] == rows[1]
    assert ("1.weight", 1) in rows[0] and ("1.bias", 1) in rows[0]


def test_only_the_variables_made_in_the_scope_follow_the_anchor_and_they_still_pickle():
    """A parameter added in the scope to a module built before it: the module's older weight and bias were
    colocated too, and every later variable's turn moved; and the mark, a weak reference in the tensor's __dict__,
    made torch.save(model) fail (cannot pickle 'weakref.ReferenceType')."""
    import io

    from launcher import distribute as dl

    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "c": nn.Linear(2, 2)})
    with dl.OneDeviceStrategy("cpu:0").extended.colocate_vars_with(model["b"].weight):
        model["a"].extra = nn.Parameter(torch.zeros(2))
    placement = pt.place_module(model, num_ps=3)
    assert [(s.name, s.ps) for s in placement.shards] == [
        ("a.weight", 0), ("a.bias", 1), ("b.weight", 2), ("b.bias", 0), ("c.weight", 1), ("c.bias", 2), ("a.extra", 2)]
    torch.save(model, io.BytesIO())
