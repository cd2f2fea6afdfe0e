"""PerReplica and the nest helpers in launcher.distribute.values."""

import collections

import torch

from launcher.distribute.values import PerReplica, contains_per_replica, map_structure, regroup, select_replica

Pair = collections.namedtuple("Pair", "x y")


def test_per_replica_holds_components_in_order():
    v = PerReplica([torch.tensor(1), torch.tensor(2)])
    assert len(v) == 2
    assert v.values == (torch.tensor(1), torch.tensor(2))
    assert "0: tensor(1)" in repr(v)


def test_map_structure_keeps_nest_types():
    out = map_structure(lambda a, b: a + b, {"k": [1, (2, 3)], "p": Pair(1, 2)}, {"k": [10, (20, 30)], "p": Pair(5, 6)})
    assert out == {"k": [11, (22, 33)], "p": Pair(6, 8)}
    assert type(out["p"]) is Pair


def test_select_replica_picks_each_components_index():
    tree = {"a": PerReplica([1, 2]), "b": (PerReplica(["x", "y"]), "same")}
    assert select_replica(0, tree) == {"a": 1, "b": ("x", "same")}
    assert select_replica(1, tree) == {"a": 2, "b": ("y", "same")}
    assert select_replica(1, PerReplica([3, 4])) == 4


def test_regroup_turns_per_replica_structures_into_structure_of_per_replica():
    out = regroup([(1, {"k": "a"}), (2, {"k": "b"})])
    assert isinstance(out, tuple)
    assert out[0].values == (1, 2)
    assert out[1]["k"].values == ("a", "b")


def test_regroup_keeps_namedtuples():
    out = regroup([Pair(1, 2), Pair(3, 4)])
    assert type(out) is Pair
    assert out.x.values == (1, 3) and out.y.values == (2, 4)


def test_regroup_of_none_is_none():
    assert regroup([None, None]) is None


def test_regroup_of_mismatched_structures_wraps_them_whole():
    out = regroup([(1, 2), (1, 2, 3)])
    assert isinstance(out, PerReplica)
    assert out.values == ((1, 2), (1, 2, 3))


def test_contains_per_replica():
    assert contains_per_replica(PerReplica([1]))
    assert contains_per_replica({"a": [1, PerReplica([1, 2])]})
    assert not contains_per_replica({"a": [1, torch.ones(1)]})


def test_run_can_return_a_torch_size(strategy):
    out = strategy.run(lambda: torch.zeros(2, 3).shape)
    assert tuple(tuple(r) for r in strategy.experimental_local_results(out)) == ((2, 3), (2, 3))
