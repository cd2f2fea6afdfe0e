"""Checkpoints written from ps shards: whole variables in DCP's metadata, loadable by one device or another layout."""

from __future__ import annotations

import pytest
import torch

from launcher.checkpoint import _load, read_tensors, shards, state
from launcher.checkpoint.safe import SafeReader
from launcher.distribute.partitioners import FixedShardsPartitioner
from launcher.distribute.ps_placement import place_module
from launcher.distribute.server import VariableStore
from launcher.strategies.parameter_server import contents_for

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.1),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1))


def trained_store(make_optimizer, num_shards: int = 3) -> VariableStore:
    m = model()
    store = VariableStore(0)
    store.create(contents_for(0, m, make_optimizer(m.parameters()), place_module(m, 1, FixedShardsPartitioner(num_shards))))
    for value in store.shards.values():
        value.grad = torch.ones_like(value)
    store.optimizer.step()
    return store


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_shards_save_as_whole_variables_and_load_into_one_device(tmp_path, name):
    store = trained_store(OPTIMIZERS[name])
    shards.save(store, tmp_path, (7, 1, 2))
    metadata = SafeReader(str(tmp_path)).read_metadata().state_dict_metadata
    table = metadata["model.0.weight"]
    assert table.size == torch.Size([10, 4]) and sorted(c.offsets[0] for c in table.chunks) == [0, 4, 7]  # TF's 4, 3, 3 rows

    one = model()
    optimizer = OPTIMIZERS[name](one.parameters())
    tensors = {**state.model_and_optimizer(one, optimizer), "progress": state.progress(0, 0, 0)}
    _load(tensors, tmp_path)
    state.load_model_and_optimizer(one, optimizer, tensors)
    whole = torch.cat([store.shards[f"0.weight/part_{i}"] for i in range(3)])
    assert torch.equal(one[0].weight, whole)
    assert int(tensors["progress"]["step"]) == 7
    saved = store.optimizer.state[store.shards["0.weight/part_1"]]
    loaded = optimizer.state_dict()["state"][0]
    for key, value in saved.items():
        expected = value if value.dim() == 0 else value
        got = loaded[key] if value.dim() == 0 else loaded[key][4:7]
        assert torch.equal(got, expected), key
    assert torch.equal(read_tensors(tmp_path)["0.weight"], whole)


def test_a_ps_reads_back_its_rows_even_when_the_checkpoint_was_cut_differently(tmp_path):
    store = trained_store(OPTIMIZERS["adam"], num_shards=3)
    shards.save(store, tmp_path, (5, 0, 5))
    other = VariableStore(0)
    m = model()
    other.create(contents_for(0, m, OPTIMIZERS["adam"](m.parameters()), place_module(m, 1, FixedShardsPartitioner(2))))
    assert shards.load(other, tmp_path) == (5, 0, 5)
    whole = torch.cat([store.shards[f"0.weight/part_{i}"] for i in range(3)])
    assert torch.equal(torch.cat([other.shards["0.weight/part_0"], other.shards["0.weight/part_1"]]), whole)
    step = other.optimizer.state[other.shards["0.weight/part_1"]]["step"]
    assert float(step) == 1.0  # the variable's scalar state reaches every shard
