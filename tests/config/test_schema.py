"""Cross-field rules: they show their arithmetic and name the key to change."""

from __future__ import annotations

import pytest

from launcher.config import compose as composer
from launcher.config.errors import ConfigError


def problems(overrides, cuda_devices=0):
    with pytest.raises(ConfigError) as info:
        composer.compose_and_validate(overrides, cuda_devices=cuda_devices)
    return info.value.problems


def test_indivisible_batch_shows_the_arithmetic():
    (p,) = problems(["strategy=mirrored", "cluster=1x3", "input.global_batch_size=64"])
    assert p.key == "input.global_batch_size" and p.value == 64
    assert "cluster 1x3 = 3 replicas" in p.message and "not divisible by 3" in p.message


def test_more_cuda_devices_than_exist():
    (p,) = problems(["strategy=mirrored", "cluster=1x4", "cluster.device=cuda"], cuda_devices=2)
    assert p.key == "cluster.devices_per_node"
    assert "asks for 4 CUDA devices per node, but this machine has 2" in p.message


def test_auto_device_uses_cuda_when_present():
    spec = composer.compose_and_validate(["strategy=mirrored", "cluster=1x2"], cuda_devices=2)
    assert spec.device_type(2) == "cuda" and spec.backend(2) == "nccl"
    assert spec.device_type(0) == "cpu" and spec.backend(0) == "gloo"


def test_nccl_needs_cuda():
    (p,) = problems(["strategy=mirrored", "cluster=1x2", "cluster.backend=nccl"])
    assert p.key == "cluster.backend"


def test_one_device_rejects_several_devices():
    (p,) = problems(["strategy=one_device", "cluster=1x2"])
    assert p.key == "cluster" and "1 replica" in p.message


def test_several_nodes_are_refused_clearly():
    (p,) = problems(["strategy=mirrored", "cluster=2x8"])
    assert p.key == "cluster" and "2 nodes" in p.message


def test_a_strategy_the_recipe_does_not_declare():
    (p,) = problems(["recipe.strategies=[one_device]", "strategy=mirrored", "cluster=1x2"])
    assert p.key == "strategy" and "declares strategies one_device" in p.message


def test_all_problems_are_reported_together():
    found = problems(["trainer.steps=0", "trainer.log_every=-1", "launch.max_restarts=-2"])
    assert {p.key for p in found} == {"trainer.steps", "trainer.log_every", "launch.max_restarts"}


def test_cross_device_ops_in_the_plan():
    from launcher.config.schema import MirroredSpec, MultiWorkerMirroredSpec

    assert MirroredSpec(name="mirrored").describe() == "mirrored (DDP all-reduce, 25 MB buckets)"
    spec = MultiWorkerMirroredSpec(name="multi_worker_mirrored", cross_device_ops="reduction_to_one_device")
    assert spec.describe() == "multi_worker_mirrored (DDP + cross_device_ops reduction_to_one_device, 25 MB buckets)"
