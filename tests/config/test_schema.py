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
    (p,) = problems(["strategy=mirrored", "cluster=1x3", "input.global_batch_size=64"], 0)
    assert p.key == "input.global_batch_size" and p.value == 64
    assert "cluster 1x3 = 3 replicas" in p.message and "not divisible by 3" in p.message


def test_more_cuda_devices_than_exist():
    (p,) = problems(["strategy=mirrored", "cluster=1x4", "cluster.device=cuda"], cuda_devices=2)
    assert p.key == "cluster.devices_per_node"
    assert "asks for 4 CUDA devices per node, but this machine has 2" in p.message



def test_emulated_nodes_of_a_cuda_job_need_a_gpu_per_process_of_every_node():
    """cluster=2x4 with no node_rank runs both nodes here: 8 processes, one GPU each (a real node sets node_rank)."""
    (p,) = problems(["strategy=multi_worker_mirrored", "cluster=2x4", "cluster.device=cuda"], cuda_devices=4)
    assert p.key == "cluster.nodes" and p.value == 2
    assert "emulates 2 nodes on this machine" in p.message and "2 x 4 = 8, but this machine has 4" in p.message
    composer.compose_and_validate(["strategy=multi_worker_mirrored", "cluster=2x4", "cluster.device=cuda"], cuda_devices=8)
    composer.compose_and_validate(["strategy=multi_worker_mirrored", "cluster=2x4", "cluster.device=cuda",
                                   "cluster.node_rank=1", "cluster.master_addr=10.0.0.1", "cluster.master_port=29500"], cuda_devices=4)

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


def test_several_nodes_without_a_node_rank_are_emulated():
    spec = composer.compose_and_validate(["strategy=mirrored", "cluster=2x8", "input.global_batch_size=64"], 0)
    assert spec.cluster.emulated and spec.num_replicas == 16


def test_a_node_rank_outside_the_cluster():
    (p,) = problems(["strategy=mirrored", "cluster=2x2", "cluster.node_rank=2", "cluster.master_port=29500"])
    assert p.key == "cluster.node_rank" and "node_rank 2 is not a node of cluster 2x2 (0..1)" in p.message


def test_a_node_rank_needs_a_fixed_port():
    (p,) = problems(["strategy=mirrored", "cluster=2x2", "cluster.node_rank=1"])
    assert p.key == "cluster.master_port" and "give a port" in p.message


def test_a_cluster_given_as_a_task_list():
    spec = composer.compose_and_validate([
        "strategy=mirrored", "cluster=tasks", "cluster.devices_per_node=2",
        "cluster.tasks={chief: ['127.0.0.1:29500'], worker: ['127.0.0.1:29501', '127.0.0.1:29502']}",
        "cluster.task={type: worker, index: 1}", "input.global_batch_size=60",
    ], 0)
    c = spec.cluster
    assert (c.nodes, c.node_rank, c.master_addr, c.master_port, c.world_size) == (3, 2, "127.0.0.1", 29500, 6)


def test_a_task_list_is_the_whole_cluster_as_a_tf_config_is():
    """TF's usual multi-worker list names workers only (worker 0 is the chief): the `cluster=tasks` option's own demo
    chief is not merged in as a third node, and `{}` lists no node rather than the demo's two."""
    overrides = ["strategy=multi_worker_mirrored", "cluster=tasks", "cluster.tasks={worker: ['localhost:12345', 'localhost:23456']}",
                 "cluster.task={type: worker, index: 1}"]
    c = composer.compose_and_validate(composer.choose_user_recipes(overrides), 0).cluster
    assert (c.nodes, c.node_rank, c.master_addr, c.master_port, c.world_size) == (2, 1, "localhost", 12345, 2)
    (p,) = problems(composer.choose_user_recipes(["strategy=mirrored", "cluster=tasks", "cluster.tasks={}"]))
    assert p.key == "cluster.tasks" and "lists no node" in p.message


def test_a_task_that_is_not_in_the_list():
    (p,) = problems(["strategy=mirrored", "cluster=tasks", "cluster.task={type: worker, index: 5}"])
    assert p.key == "cluster.task" and "worker:5 is not in cluster.tasks" in p.message


def test_a_strategy_the_recipe_does_not_declare():
    (p,) = problems(["recipe.strategies=[one_device]", "strategy=mirrored", "cluster=1x2"])
    assert p.key == "strategy" and "declares strategies one_device" in p.message
    assert p.message.endswith(f"(to run it anyway: 'recipe.strategies=[{p.value}]')")  # the way past it, which runs:
    composer.compose_and_validate(["recipe.strategies=[mirrored]", "strategy=mirrored", "cluster=1x2", "cluster.device=cpu"],
                                  cuda_devices=0)


def test_all_problems_are_reported_together():
    found = problems(["trainer.steps=0", "trainer.log_every=-1", "launch.max_restarts=-2"])
    assert {p.key for p in found} == {"trainer.steps", "trainer.log_every", "launch.max_restarts"}


def test_cross_device_ops_in_the_plan():
    from launcher.config.schema import MirroredSpec, MultiWorkerMirroredSpec

    assert MirroredSpec(name="mirrored").describe() == "mirrored (DDP all-reduce, through shared memory on one CPU machine, 25 MB buckets)"
    spec = MultiWorkerMirroredSpec(name="multi_worker_mirrored", cross_device_ops="reduction_to_one_device")
    assert spec.describe() == "multi_worker_mirrored (DDP + cross_device_ops reduction_to_one_device, 25 MB buckets)"


def test_a_resume_path_is_checked_on_disk_by_the_parent_only(tmp_path):
    """Workers trust the parent's check: a restarted worker resumes from the newest checkpoint, and retention may
    have removed the one the command started from by then."""
    from launcher.config.schema import RunSpec

    gone = tmp_path / "checkpoints" / "step-00000004"
    assert any(p.key == "trainer.resume" and "no checkpoint at" in p.message for p in problems([f"trainer.resume={gone}"]))
    (tmp_path / "checkpoints").mkdir()
    gone.mkdir()
    data = composer.compose_and_validate([f"trainer.resume={gone}"], cuda_devices=0).model_dump(mode="json")
    gone.rmdir()
    assert RunSpec.model_validate(data, context={"cuda_devices": 0}).trainer.resume == str(gone)  # as a worker validates


def test_bf16_on_a_gpu_that_only_emulates_it_is_refused(monkeypatch):
    """A V100 (7.0): torch.cuda.is_bf16_supported() says True there (emulation), so the capability decides. The
    GPU is stood in for (there is none here); the rule and its message are dlaunch's own. The parent asks the
    driver (``gpus.devices``, tested against torch in tests/cluster/test_gpus.py), never torch.cuda."""
    from launcher.cluster import gpus

    monkeypatch.setattr(gpus, "devices", lambda: (gpus.Device(8, 0, "NVIDIA A100"), gpus.Device(7, 0, "Tesla V100-SXM2-16GB")))
    both = ["trainer.precision=bf16-mixed", "cluster.device=cuda", "strategy=mirrored", "cluster=1x2"]
    (p,) = problems(both, cuda_devices=2)
    assert p.key == "trainer.precision" and "Tesla V100-SXM2-16GB (compute capability 7.0) does not compute in bf16" in p.message
    composer.compose_and_validate(["trainer.precision=bf16-mixed", "cluster.device=cuda"], cuda_devices=2)  # cuda:0 only
    (p,) = problems(["trainer.precision=bf16-mixed", "cluster.device=cuda", "strategy.device=cuda:1"], cuda_devices=2)
    assert "Tesla V100-SXM2-16GB" in p.message  # the device one_device names, not cuda:0
    composer.compose_and_validate(["trainer.precision=bf16-mixed", "strategy=central_storage",
                                   "strategy.compute_devices=[cuda:0]"], cuda_devices=2)
    monkeypatch.setattr(gpus, "devices", lambda: (gpus.Device(9, 0, "NVIDIA H100"),) * 2)
    composer.compose_and_validate(both, cuda_devices=2)
