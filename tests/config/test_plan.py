"""The resolved plan: worked out once from a validated spec, written into the job file, read back by workers."""

from __future__ import annotations

import json

import pytest

from launcher.config.compose import compose_and_validate
from launcher.config.plan import Plan, read_job


def _plan(*overrides: str, cuda: int = 0) -> Plan:
    return Plan.resolve(compose_and_validate(list(overrides), cuda_devices=cuda), cuda)


def test_data_parallel_on_cpu():
    p = _plan("recipe=linear", "strategy=mirrored", "cluster=1x2", "input.global_batch_size=32")
    assert (p.device_type, p.backend, p.world_size, p.processes, p.replicas) == ("cpu", "gloo", 2, 2, 2)
    assert p.mesh == {"dims": ["replica"], "shape": [2]}
    assert (p.global_batch_size, p.per_replica_batch_size, p.micro_batch_size) == (32, 16, 16)


def test_the_mesh_and_the_parameter_server_give_their_own_shapes():
    mesh = _plan("recipe=tp_mlp", "strategy=mesh", "cluster=1x4")
    assert (mesh.world_size, mesh.replicas, mesh.mesh["shape"]) == (4, 2, [2, 2])
    ps = _plan("recipe=wide_deep", "strategy=parameter_server", "cluster.workers=1", "cluster.ps=2")
    assert (ps.world_size, ps.processes, ps.replicas) == (4, 2, 2)  # chief, worker, 2 ps; two of them read data


def test_the_job_file_carries_the_plan(tmp_path):
    from launcher.launch.elastic import write_job

    spec = compose_and_validate(["recipe=linear", "strategy=mirrored", "cluster=1x2"], cuda_devices=0)
    plan = Plan.resolve(spec, 0)
    job = json.loads(write_job(spec, tmp_path, plan).read_text())
    assert set(job) == {"spec", "plan", "run_dir", "log_file", "console_tag"}  # the CUDA count the parent saw lives in the plan alone
    assert read_job(job) == (spec, plan)


def test_a_worker_judges_the_spec_by_the_parents_cuda_count(tmp_path):
    """Written on a machine with 2 CUDA devices, a cuda 1x2 job reads back as such wherever it is read."""
    from launcher.launch.elastic import write_job

    spec = compose_and_validate(["recipe=linear", "strategy=mirrored", "cluster=1x2", "cluster.device=cuda"], cuda_devices=2)
    job = json.loads(write_job(spec, tmp_path, Plan.resolve(spec, 2)).read_text())
    again, plan = read_job(job)
    assert again == spec and (plan.device_type, plan.backend, plan.cuda_devices) == ("cuda", "nccl", 2)


@pytest.mark.parametrize(("overrides", "launcher"), [
    (["recipe=linear", "strategy=one_device"], "InProcess"),
    (["recipe=linear", "strategy=central_storage", "strategy.compute_devices=[cpu:0,cpu:1]"], "InProcess"),
    (["recipe=linear", "strategy=one_device", "launch.max_restarts=1"], "ElasticProcesses"),
    (["recipe=linear", "strategy=mirrored", "cluster=1x2"], "ElasticProcesses"),
    (["recipe=linear", "strategy=mirrored", "cluster=2x2"], "EmulatedNodes"),
    (["recipe=wide_deep", "strategy=parameter_server", "cluster.ps=1"], "Tasks"),
])
def test_the_strategy_names_its_launcher(overrides, launcher):
    from launcher.launch import launchers

    spec = compose_and_validate(overrides, cuda_devices=0)
    assert type(launchers.choose(spec)).__name__ == launcher
