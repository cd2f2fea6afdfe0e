"""Building strategies from a validated spec, by name."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from launcher import strategies
from launcher.config.compose import compose_and_validate


def test_unknown_strategy_lists_the_available_ones():
    class Spec:
        name = "centre"

    with pytest.raises(KeyError, match="available: central_storage, fsdp, mesh, mirrored, multi_worker_mirrored, one_device, parameter_server"):
        strategies.build(Spec(), strategies.Runtime(None, "cpu", "gloo"))


def test_an_in_process_run_ignores_rank_variables_in_the_shell(monkeypatch):
    """A parent shell with RANK/WORLD_SIZE set must not make a one-process run wait for peers."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    spec = compose_and_validate(["strategy=mirrored", "cluster=1x1"], cuda_devices=0)
    s = strategies.build(spec.strategy, strategies.Runtime(None, "cpu", "gloo"))
    assert s.num_replicas_in_sync == 1 and not dist.is_initialized()
    assert s.cluster_resolver is None
