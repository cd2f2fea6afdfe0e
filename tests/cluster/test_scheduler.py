"""SLURM tasks (and submitit's local tasks) become dlaunch nodes through the SLURM resolver."""

from __future__ import annotations

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


def test_outside_a_scheduler_nothing_changes(monkeypatch):
    for key in (*SLURM, "SUBMITIT_LOCAL_GLOBALID"):
        monkeypatch.delenv(key, raising=False)
    cluster = ClusterSpec(nodes=2, devices_per_node=2)
    assert placed(cluster) is cluster and placed(cluster).emulated
