"""SLURM tasks (and submitit's local tasks) become dlaunch nodes through the SLURM resolver."""

from __future__ import annotations

import os

import pytest

from launcher.cluster.env import scheduler_tasks
from launcher.cluster.scheduler import PORT_BASE, PlacementError, placed
from launcher.config.schema import ClusterSpec

SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_TASKS_PER_NODE": "1(x2)",
         "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242"}


def test_a_slurm_task_is_the_node_of_its_procid(monkeypatch):
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    c = placed(ClusterSpec(nodes=2, devices_per_node=8))
    assert (c.node_rank, c.master_addr, c.master_port) == (1, "gpu07", PORT_BASE + 4242)
    assert not c.loopback


def test_a_given_port_is_kept(monkeypatch):
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    assert placed(ClusterSpec(nodes=2, devices_per_node=8, master_port=29500)).master_port == 29500


def test_several_tasks_per_node_are_refused(monkeypatch):
    for key, value in {**SLURM, "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(PlacementError, match="4 task\\(s\\), but cluster 2x8 has 2 nodes"):
        placed(ClusterSpec(nodes=2, devices_per_node=8))


def test_submitit_local_tasks_read_as_slurm_tasks():
    tasks = scheduler_tasks({"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_JOB_ID": "77"})
    assert tasks == {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost",
                     "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_ID": "77"}



def test_a_submitit_local_task_keeps_its_own_slice_of_the_gpus_and_a_slurm_task_its_nodes(monkeypatch):
    """submitit_local shows every task all 2 x 4 GPUs (gpus_per_node=8); node 1 keeps 4-7. Under SLURM, a task's
    GPUs are its own node's: nothing is narrowed."""
    for key in SLURM:
        monkeypatch.delenv(key, raising=False)
    local = {"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_NTASKS": "2", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    for key, value in local.items():
        monkeypatch.setenv(key, value)
    assert placed(ClusterSpec(nodes=2, devices_per_node=4)).node_rank == 1
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    monkeypatch.delenv("SUBMITIT_LOCAL_GLOBALID")
    for key, value in {**SLURM, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}.items():
        monkeypatch.setenv(key, value)
    placed(ClusterSpec(nodes=2, devices_per_node=4))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"

def test_outside_a_scheduler_nothing_changes(monkeypatch):
    for key in (*SLURM, "SUBMITIT_LOCAL_GLOBALID"):
        monkeypatch.delenv(key, raising=False)
    cluster = ClusterSpec(nodes=2, devices_per_node=2)
    assert placed(cluster) is cluster and placed(cluster).emulated
