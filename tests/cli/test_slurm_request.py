"""The submit side of SLURM without a cluster: sinfo's answer, ``cluster.device=auto``, the request, sbatch's refusals."""

from __future__ import annotations

import io
import os
import shutil
import subprocess

import pytest
from rich.console import Console

from launcher.cli import slurm
from launcher.config.compose import compose_and_validate
from launcher.config.errors import ConfigError
from tests.conftest import dlaunch

REMOTE = 1 << 16
SINFO = slurm.parse_sinfo("debug*|2|(null)|1\ngpu|64|gpu:a100:8(S:0-1)|4\nmixed|32|gpu:4|2\nmixed|32|(null)|6\n")


def spec(*overrides):
    return compose_and_validate(["strategy=mirrored", "cluster=1x2", *overrides], REMOTE)


def test_sinfo_is_read_per_partition_with_its_default():
    assert SINFO.default == "debug"
    assert SINFO.get(None) == slurm.Partition("debug", cpus=(2,), gpus=(0,), nodes=(1,))
    assert SINFO.get("gpu").gpus == (8,) and SINFO.get("mixed").gpus == (4, 0)
    assert slurm.parse_sinfo("p|4|gpu:1,gpu:tesla:2|1\n").get("p").gpus == (3,)


def test_auto_runs_on_what_the_partition_has():
    assert slurm.device(spec(), SINFO, "gpu") == ("cuda", "cluster.device=auto and partition gpu has gpu:8 per node (sinfo; 64 CPUs per node)")
    assert slurm.device(spec(), SINFO, None)[0] == "cpu"
    assert slurm.device(spec("cluster.device=cuda"), slurm.Sinfo(error="unused"), None) == ("cuda", "cluster.device=cuda")


@pytest.mark.parametrize("info,partition,key,words", [
    (SINFO, "mixed", "cluster.device", "only some nodes"),
    (slurm.Sinfo(error="sinfo exited 1: slurm_load_partitions: Unable to contact slurm controller"), "gpu", "cluster.device", "Unable to contact"),
    (SINFO, "nope", "hydra.launcher.partition", "sinfo lists: debug, gpu, mixed"),
])
def test_auto_that_cannot_be_decided_is_a_config_error(info, partition, key, words):
    with pytest.raises(ConfigError) as caught:
        slurm.device(spec(), info, partition)
    (problem,) = caught.value.problems
    assert problem.key == key and words in problem.message


def test_the_request_names_every_resource_and_where_to_change_it():
    params = {**slurm.queue_defaults(), "partition": "debug", "nodes": 2, "cpus_per_task": 2}
    rows = dict(slurm.request_rows(params, "cluster.device=cpu", 2, 3))
    assert rows["gres"] == "none: cluster.device=cpu" and rows["cpus"] == "2 per task"
    assert rows["time"] == "60 min (hydra.launcher.timeout_min)" and rows["jobs"] == "3, as one sbatch job array"
    assert slurm.asked(params) == "partition=debug nodes=2 tasks_per_node=1 cpus_per_task=2 timeout_min=60"


def test_cpu_workers_get_a_cpu_each_as_far_as_a_node_has_them():
    assert slurm.cpus_per_task(spec(), "cpu", SINFO.get("gpu")) == {"cpus_per_task": 2}
    assert slurm.cpus_per_task(spec("cluster=1x4"), "cpu", SINFO.get("debug")) == {"cpus_per_task": 2}  # 4 workers share 2 CPUs
    # GPU nodes: the node's CPUs in proportion to the GPUs taken, at least a CPU per worker and loader process
    assert slurm.cpus_per_task(spec("cluster=1x8"), "cuda", SINFO.get("gpu")) == {"cpus_per_task": 64}
    assert slurm.cpus_per_task(spec(), "cuda", SINFO.get("gpu")) == {"cpus_per_task": 16}  # 2 of 8 GPUs: 64 x 2 / 8
    assert slurm.cpus_per_task(spec("cluster=1x2", "input.num_workers=7"), "cuda", SINFO.get("mixed")) == {"cpus_per_task": 16}
    assert slurm.cpus_per_task(spec("cluster=1x4", "input.num_workers=15"), "cuda", SINFO.get("mixed")) == {"cpus_per_task": 32}
    assert slurm.cpus_per_task(spec("cluster=1x2", "input.num_workers=3"), "cuda", None) == {"cpus_per_task": 8}  # no sinfo


def test_a_job_no_node_can_hold_is_refused_before_it_waits_in_the_queue_for_ever():
    params = {"nodes": 2, "tasks_per_node": 1, "cpus_per_task": 4}
    problems = slurm.fits(params, spec("cluster=2x1"), SINFO.get("debug"))
    assert [p.key for p in problems] == ["cluster", "hydra.launcher.cpus_per_task"]
    assert "partition debug has 1 node(s) (sinfo) and cluster 2x1 needs 2" in problems[0].message
    assert "at most 2 CPUs (sinfo) and the job asks 4 per node" in problems[1].message
    assert slurm.fits(params, spec("cluster=2x1"), None) == []  # sinfo could not tell: sbatch judges


@pytest.mark.parametrize("said,params,fix", [
    ("sbatch: error: invalid partition specified: nope", {}, "hydra.launcher.partition"),
    ("sbatch: error: Invalid generic resource (gres) specification", {"gpus_per_node": 8}, "cluster.device=cpu"),
    ("sbatch: error: Invalid generic resource (gres) specification", {"gres": "gpu:9"}, "hydra.launcher.gres"),
    ("sbatch: error: Batch job submission failed: Requested time limit is invalid", {}, "hydra.launcher.timeout_min"),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available", {}, "cluster=NxM"),
    ("sbatch: error: something new", {}, "the hydra.launcher.* setting"),
])
def test_a_refusal_names_the_override_to_change(said, params, fix):
    assert slurm.fix_for(said, params).startswith(fix)


def test_a_refusal_is_one_screen():
    out = io.StringIO()
    said = "\n".join(f"sbatch: error: line {i}" for i in range(20))
    slurm.render_refusal({"partition": "p", "nodes": 1, "tasks_per_node": 1}, said, Console(file=out, width=200))
    lines = out.getvalue().splitlines()
    assert len(lines) <= 12 and "line 19" in lines[-3] and "asked:       partition=p nodes=1 tasks_per_node=1" in lines[1]


def test_only_sbatch_s_own_failure_counts_as_a_refusal():
    from submitit.core.utils import FailedJobError

    def raised(cause):
        try:
            raise FailedJobError("x") from cause
        except FailedJobError as exc:
            return exc

    assert slurm._from_sbatch(raised(subprocess.CalledProcessError(1, ["sbatch", "job.sh"])))
    assert not slurm._from_sbatch(raised(None))


def test_auto_jobs_that_land_on_cpu_nodes_are_checked_again_for_the_cpu():
    nccl = spec("cluster.backend=nccl")  # fine for the GPU nodes the submit host assumed
    slurm.check_on_cpu([nccl], "cuda", "unused")
    with pytest.raises(ConfigError) as caught:
        slurm.check_on_cpu([nccl], "cpu", "cluster.device=auto and partition debug has no GPU gres")
    assert [p.key for p in caught.value.problems] == ["cluster.backend", "cluster.device"]
    slurm.check_on_cpu([spec()], "cpu", "unused")


def _stand_ins(tmp_path, sinfo: str, sbatch: str) -> dict:
    """PATH with a stand-in sinfo, sbatch and srun (shell scripts): the whole submit path runs without SLURM.

    submitit's SLURM executor looks for srun on PATH before it submits; nothing runs it here.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sinfo", sinfo), ("sbatch", sbatch), ("srun", "exit 1")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_without_slurm_a_refusal_and_a_dry_run_go_the_whole_way(tmp_path):
    env = _stand_ins(tmp_path, "echo 'debug*|2|(null)|1'",
                     "echo 'sbatch: error: Invalid generic resource (gres) specification' >&2; exit 1")
    refused = dlaunch("hydra/launcher=submitit_slurm", "strategy=mirrored", "cluster=1x2", "cluster.device=cuda",
                      f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, env=env, device=None)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert "SLURM said:  sbatch: error: Invalid generic resource (gres) specification" in refused.stderr
    assert "change:      cluster.device=cpu" in refused.stderr and "gres         gpu:2 per node: cluster.device=cuda" in refused.stdout

    dry = dlaunch("hydra/launcher=submitit_slurm", "strategy=mirrored", "cluster=1x2", "launch.dry_run=true", cwd=tmp_path, env=env, device=None)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "gres         none: cluster.device=auto and partition debug has no GPU gres" in dry.stdout
    assert "launch.dry_run=true: nothing was submitted (1 job(s) would be)" in dry.stdout


def test_a_machine_without_the_slurm_client_is_told_so_on_one_screen(tmp_path):
    """No srun or sbatch on PATH (submitit asks for srun first): exit 2, what to do instead, no traceback."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(shutil.which("sh"), bin_dir / "sh")
    env = {"PATH": str(bin_dir)}  # not even the stand-ins; cluster.device=cpu needs no sinfo
    proc = dlaunch("hydra/launcher=submitit_slurm", "strategy=mirrored", "cluster=1x2", "cluster.device=cpu",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, env=env, device=None)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    text = " ".join(proc.stderr.split())
    assert "cannot find srun on PATH (this machine is not a SLURM submit host)" in text
    assert "hydra/launcher=submitit_local" in text
