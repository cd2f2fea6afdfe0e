"""hydra-submitit-launcher: cluster=NxM becomes the allocation, and a 2x2 job runs through submitit_local."""

from __future__ import annotations

import pytest

from launcher.cli import scheduled, slurm
from launcher.config.compose import compose_and_validate
from launcher.config.errors import ConfigError
from tests.conftest import dlaunch, summary

REMOTE = 1 << 16


def spec(*overrides):
    return compose_and_validate(["strategy=mirrored", "input.global_batch_size=64", *overrides], REMOTE)


GPU_PARTITION = slurm.parse_sinfo("gpu*|64|gpu:8(S:0-1)|4\ncpu|32|(null)|8\n")


def test_slurm_gets_nodes_one_task_per_node_and_gpus():
    s = spec("cluster=2x8")
    assert scheduled.resources("submitit_slurm", s, "cuda") == {"nodes": 2, "tasks_per_node": 1, "gpus_per_node": 8}
    assert scheduled.resources("submitit_slurm", s, "cpu") == {"nodes": 2, "tasks_per_node": 1}
    # submitit_local shows each task only the GPUs asked for (none without gpus_per_node); each takes its slice
    assert scheduled.resources("submitit_local", s) == {"nodes": 1, "tasks_per_node": 2, "gpus_per_node": 16}
    assert scheduled.resources("submitit_local", s, "cpu") == {"nodes": 1, "tasks_per_node": 2}


def test_overrides_fill_in_what_the_user_left_out():
    extra = scheduled.resource_overrides("submitit_slurm", ["hydra.launcher.nodes=2"], [spec("cluster=2x8")], lambda: GPU_PARTITION)
    # a node's 8 GPUs, and so its 64 CPUs: SLURM's default of one CPU per task would hold 8 workers on one
    assert extra == ["hydra.launcher.tasks_per_node=1", "hydra.launcher.gpus_per_node=8", "hydra.launcher.cpus_per_task=64"]


def test_a_cpu_job_asks_a_cpu_per_worker_unless_told_otherwise():
    overrides = ["hydra.launcher.partition=cpu"]
    extra = scheduled.resource_overrides("submitit_slurm", overrides, [spec("cluster=1x4")], lambda: GPU_PARTITION)
    assert extra == ["hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=4"]
    mine = scheduled.resource_overrides("submitit_slurm", [*overrides, "hydra.launcher.cpus_per_task=16"], [spec("cluster=1x4")], lambda: GPU_PARTITION)
    assert "hydra.launcher.cpus_per_task=4" not in mine


def test_a_conflicting_allocation_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        scheduled.resource_overrides("submitit_slurm", ["hydra.launcher.nodes=3"], [spec("cluster=2x8")], lambda: GPU_PARTITION)
    (p,) = info.value.problems
    assert p.key == "hydra.launcher.nodes" and "needs nodes=2" in p.message


def test_a_sweep_over_cluster_shapes_is_refused():
    with pytest.raises(ConfigError, match="one allocation shape"):
        scheduled.resource_overrides("submitit_slurm", [], [spec("cluster=1x8"), spec("cluster=2x8")], lambda: GPU_PARTITION)


def test_launcher_is_read_from_the_overrides():
    assert scheduled.launcher_of(["x=1", "hydra/launcher=submitit_slurm"]) == "submitit_slurm"
    assert scheduled.launcher_of(["hydra/launcher=basic"]) is None


@pytest.mark.slow
def test_a_2x2_job_through_submitit_local(tmp_path):
    common = ("recipe=linear", "strategy=mirrored", "trainer.steps=20", "input.global_batch_size=32")
    proc = dlaunch("hydra/launcher=submitit_local", *common, "cluster=2x2", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = tmp_path / "sweep" / "0"
    result = summary(job)
    assert (result["status"], result["world_size"]) == ("completed", 4)
    log = (job / "dlaunch.log").read_text()
    assert "scheduler task 1 of 2: node 1" in log and "starting 2 worker process(es) on node 1 of 2" in log

    # the model one device trains on the same global batches (a one-process reference, not a second 4-rank job)
    one = dlaunch(*[a for a in common if a != "strategy=mirrored"], "strategy=one_device",
                  f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    assert result["param_norm"] == pytest.approx(summary(tmp_path / "one")["param_norm"], rel=1e-5)


@pytest.mark.parametrize("code", [143, 1])
def test_a_scheduled_job_that_a_signal_stopped_returns_its_summary_a_failed_one_raises(tmp_path, monkeypatch, code):
    """A stopped SLURM (or submitit_local) task raised JobFailed as a failure does: the parent's launcher re-raised it,
    and dlaunch ended with one line and exit 1, with no sweep table and no resume hint."""
    from launcher.cli import job, output
    from launcher.runtime import outputs

    monkeypatch.setenv("SUBMITIT_LOCAL_GLOBALID", "0")  # what submitit's local executor gives its task
    monkeypatch.setenv("SUBMITIT_LOCAL_NTASKS", "1")
    run = compose_and_validate(["cluster.device=cpu", "trainer.steps=20", "trainer.checkpoint.every_steps=5"], 0)
    if code == 1:
        with pytest.raises(scheduled.JobFailed, match="dlaunch exited with 1 on node 0"):
            job._ended(run, tmp_path, code, output.messages())
        return
    returned = job._ended(run, tmp_path, code, output.messages())
    assert returned == outputs.read_summary(tmp_path) and returned["status"] == "stopped"
    assert returned["exit_code"] == 143  # what the parent's sweep table reads to exit 143 (sweep.stopped_code)
