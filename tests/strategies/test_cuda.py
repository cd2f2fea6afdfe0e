"""CUDA paths: run where a GPU is present, skip cleanly elsewhere (CI has none)."""

from __future__ import annotations

import pytest
import torch

from launcher import distribute as dl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_one_device_places_parameters_and_batches_on_the_gpu():
    s = dl.OneDeviceStrategy("cuda:0")
    with s.scope():
        model = torch.nn.Linear(4, 1)
    assert model.weight.device.type == "cuda"
    (batch,) = list(s.experimental_distribute_dataset([torch.arange(8.0)]))
    assert batch.device.type == "cuda"
    assert float(s.reduce(dl.ReduceOp.SUM, s.run(lambda t: t * 2, args=(batch,)), axis=0)) == 56.0


def test_mirrored_local_replicas_on_every_gpu_agree():
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    s = dl.MirroredStrategy(devices=devices)
    v = s.experimental_distribute_values_from_function(lambda ctx: torch.tensor([float(ctx.replica_id_in_sync_group)], device=devices[ctx.replica_id_in_sync_group]))
    total = s.reduce(dl.ReduceOp.SUM, v, axis=None)
    assert float(total) == sum(range(len(devices)))


def test_one_device_on_the_last_gpu_makes_it_the_current_device():
    """strategy.device=cuda:N: what takes no device in a recipe (torch.cuda.max_memory_allocated()) means cuda:N."""
    from launcher.strategies import Runtime
    from launcher.strategies.one_device import OneDeviceSpec

    last = torch.cuda.device_count() - 1
    before = torch.cuda.current_device()
    try:
        OneDeviceSpec(name="one_device", device=f"cuda:{last}").build(Runtime(env=None, device_type="cuda", backend="nccl"))
        assert torch.cuda.current_device() == last
    finally:
        torch.cuda.set_device(before)
