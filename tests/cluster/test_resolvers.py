"""Cluster resolvers: TF_CONFIG (the seed's example), SLURM variables, torchrun's environment."""

from __future__ import annotations

import json

import pytest

from launcher.cluster.env import WorkerEnv
from launcher.distribute.cluster_resolver import (
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchElasticClusterResolver,
    validate_task,
)
from launcher.cluster.resolvers import expand_hostlist, expand_tasks_per_node

SEED_CLUSTER = {"worker": ["localhost:12345", "localhost:23456"], "ps": ["localhost:34567"]}


def tf_config(cluster=SEED_CLUSTER, task=None, **extra):
    data = {"cluster": cluster, **extra}
    if task is not None:
        data["task"] = task
    return {"TF_CONFIG": json.dumps(data)}


def test_the_seeds_tf_config_example():
    resolver = TFConfigClusterResolver(environ=tf_config(task={"type": "worker", "index": 0}))
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)
    spec = resolver.cluster_spec()
    assert spec.jobs == ["ps", "worker"] and spec.num_tasks("worker") == 2
    assert spec.task_address("ps", 0) == "localhost:34567"
    assert resolver.master() == "localhost:12345"
    assert resolver.master("ps", 0, rpc_layer="grpc") == "grpc://localhost:34567"
    validate_task(resolver)  # a complete TF_CONFIG passes


@pytest.mark.parametrize("task", [None, {"type": "worker"}, {"index": 1}])
def test_a_cluster_without_task_type_or_id_is_a_value_error(task):
    resolver = TFConfigClusterResolver(environ=tf_config(task=task))
    with pytest.raises(ValueError, match="task_type or task_id"):
        validate_task(resolver)


def test_roles_chief_worker_ps_evaluator_and_explicit_task():
    cluster = {"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1"], "evaluator": ["e:1"]}
    resolver = TFConfigClusterResolver(task_type="evaluator", task_id=0, environ=tf_config(cluster=cluster, rpc_layer="grpc"))
    assert resolver.master() == "grpc://e:1"
    assert set(resolver.cluster_spec().jobs) == {"chief", "worker", "ps", "evaluator"}


def test_no_tf_config_means_an_empty_cluster():
    resolver = TFConfigClusterResolver(environ={})
    assert not resolver.cluster_spec() and resolver.master() == ""
    validate_task(resolver)  # nothing to check: local training


def test_bad_tf_config_is_explained():
    with pytest.raises(ValueError, match="not valid JSON"):
        TFConfigClusterResolver(environ={"TF_CONFIG": "{cluster"})
    with pytest.raises(ValueError, match="'trainer' is not a job"):
        TFConfigClusterResolver(environ=tf_config(task={"type": "trainer", "index": 0}))


def test_cluster_spec_keeps_sparse_task_indices():
    spec = ClusterSpec({"worker": {1: "a:1", 3: "b:1"}})
    assert spec.task_indices("worker") == [1, 3] and spec.as_dict() == {"worker": {1: "a:1", 3: "b:1"}}
    assert ClusterSpec(spec) == spec
    with pytest.raises(ValueError, match="no such job"):
        spec.num_tasks("ps")


def test_simple_resolver():
    resolver = SimpleClusterResolver(SEED_CLUSTER, task_type="ps", task_id=0, num_accelerators={"GPU": 2})
    assert resolver.master("worker", 1) == "localhost:23456" and resolver.num_accelerators() == {"GPU": 2}


def test_torchrun_environment():
    env = WorkerEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    resolver = TorchElasticClusterResolver(env, device_type="cuda")
    assert (resolver.task_type, resolver.task_id) == ("worker", 3)
    assert resolver.master() == "10.0.0.1:29500" and resolver.cluster_spec().num_tasks("worker") == 4
    assert resolver.num_accelerators() == {"GPU": 1}


@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
    ("gpu[08-10],cpu01", ["gpu08", "gpu09", "gpu10", "cpu01"]),
])
def test_slurm_host_lists(text, hosts):
    assert expand_hostlist(text) == hosts


def test_slurm_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1", 4) == [2, 2, 2, 1]


def test_slurm_resolver_maps_procid_to_tasks():
    environ = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    resolver = SlurmClusterResolver(jobs={"ps": 1, "worker": 3}, port_base=9000, gpus_per_node=8, environ=environ)
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    assert resolver.cluster_spec().as_dict() == {"ps": ["n1:9000"], "worker": ["n1:9001", "n2:9000", "n2:9001"]}
    assert resolver.master() == "n2:9001" and resolver.num_accelerators() == {"GPU": 8}


def test_slurm_resolver_outside_slurm():
    with pytest.raises(ValueError, match="not inside a SLURM job step"):
        SlurmClusterResolver(environ={})


def test_tf_config_tasks_on_one_host_take_a_gpu_each_and_one_task_per_host_gpu_0():
    """The module's own example puts two workers on localhost: on GPUs, cuda:0 and cuda:1, not cuda:0 twice."""

    shared = ClusterSpec({"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"]})
    members = [("chief", 0), ("worker", 0), ("worker", 1)]
    assert [shared.index_on_host(m, members) for m in members] == [0, 1, 2]
    spread = ClusterSpec({"worker": ["a:1", "b:1", "a:2"]})
    members = [("worker", 0), ("worker", 1), ("worker", 2)]
    assert [spread.index_on_host(m, members) for m in members] == [0, 0, 1]



def test_parameter_server_training_tasks_on_one_gpu_machine_take_a_gpu_each(monkeypatch):
    """chief + 2 workers + 1 ps on one 4-GPU machine: cuda:0, 1, 2 (all three were on cuda:0); more tasks than
    GPUs share them round-robin; the ps tasks and a CPU job keep the CPU."""
    import torch

    from launcher.strategies.impl.parameter_server import task_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # no GPU here: the count the task's machine has
    spec = ClusterSpec({"chief": ["127.0.0.1:1"], "worker": [f"127.0.0.1:{p}" for p in (2, 3, 4, 5)], "ps": ["127.0.0.1:6"]})
    tasks = [("chief", 0), *(("worker", i) for i in range(4)), ("ps", 0)]
    assert [task_device(spec, t, "cuda") for t in tasks] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cpu:0"]
    assert task_device(spec, ("worker", 1), "cpu") == "cpu:0"
