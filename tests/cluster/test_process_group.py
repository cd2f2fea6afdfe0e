"""Where a collective's tensor must live: nccl's default group takes no CPU tensor (a 1xN GPU job's first
``checkpoint.agree`` all-reduced one on the CPU, and every rank stopped before step 1)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from launcher.cluster.process_group import comm_device


@pytest.fixture
def group():
    def join(backend: str) -> None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_gloo_group_takes_cpu_tensors(group):
    group("gloo")
    assert comm_device() == torch.device("cpu")


def test_a_group_with_no_cpu_backend_gets_the_ranks_cuda_device(group, monkeypatch):
    """``cuda:gloo`` stands in for nccl here: like nccl it has no backend for the CPU."""
    group("cuda:gloo")
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(1))  # what the CPU tensor of the old agree() met
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # no GPU here: the rank's device, as set_device left it
    assert comm_device() == torch.device("cuda", 3)
