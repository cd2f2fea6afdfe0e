"""SLURM for real: jobs submitted through ``hydra/launcher=submitit_slurm`` to a running cluster.

``make test-slurm`` starts a one-node cluster with munge on this machine (``tests/slurm/setup_slurm.sh``:
partition ``debug``, no GPU gres) and runs these tests. Elsewhere (CI's ``make test``) they skip at once,
saying why, unless ``sinfo`` already shows an idle ``debug`` partition.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import dlaunch, summary
from tests.launch.test_multi_node import COMMON, params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a SLURM run plus the same run locally
PARTITION = "debug"
SLURM = ("hydra/launcher=submitit_slurm", f"hydra.launcher.partition={PARTITION}")


def _controller_down() -> str | None:
    """Why slurmctld cannot be running, from slurm.conf and one connect (sinfo waits 9 s for a stopped controller)."""
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    text = conf.read_text() if conf.is_file() else ""
    host = re.search(r"^\s*SlurmctldHost=([^\s(]+)(?:\(([^)]+)\))?", text, re.M | re.I)
    if host is None:  # configless or unusual: leave it to sinfo
        return None
    port = re.search(r"^\s*SlurmctldPort=(\d+)", text, re.M | re.I)
    where = (host.group(2) or host.group(1), int(port.group(1)) if port else 6817)
    try:
        socket.create_connection(where, timeout=2).close()
    except OSError as exc:
        return f"slurmctld is not running: {where[0]}:{where[1]} (from {conf}): {exc}"
    return None


def _unavailable() -> str | None:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "no SLURM client here (sinfo, sbatch); `make test-slurm` installs and starts a one-node cluster"
    down = _controller_down()
    if down:
        return f"{down}; `make test-slurm` starts a one-node cluster"
    try:
        proc = subprocess.run(["sinfo", "--noheader", f"--partition={PARTITION}", "--format=%t"],
                              capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 10 s: is slurmctld running? (`make test-slurm` starts it)"
    states = proc.stdout.split()
    if proc.returncode or not any(s.rstrip("*~#") in ("idle", "mix", "alloc") for s in states):
        said = (proc.stderr or proc.stdout).strip() or "no node"
        return f"SLURM has no usable node in partition {PARTITION} ({said}); `make test-slurm` starts a one-node cluster"
    return None


@pytest.fixture(scope="module")
def slurm():
    why = _unavailable()
    if why:
        pytest.skip(why)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_mirrored_job_on_slurm_equals_the_same_job_run_here_bit_for_bit(tmp_path, slurm):
    job = (*COMMON, "cluster=1x2", "trainer.steps=20")
    proc = dlaunch(*SLURM, *job, f"hydra.sweep.dir={tmp_path / 'slurm'}", cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "cpus         2 per task" in proc.stdout and "gres         none: cluster.device=cpu" in proc.stdout
    assert "Bypassing sacct error" not in proc.stderr  # a cluster without accounting is not a warning per poll
    on_slurm = tmp_path / "slurm" / "0"
    assert summary(on_slurm)["status"] == "completed"
    assert list((tmp_path / "slurm" / ".submitit").glob("*/*_0_log.out"))  # SLURM ran it, through submitit

    local = dlaunch(*job, f"hydra.run.dir={tmp_path / 'local'}", cwd=tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    assert _same(params(on_slurm), params(tmp_path / "local"))


def test_a_two_job_sweep_on_slurm_matches_the_same_sweep_run_here(tmp_path, slurm):
    # cluster.device is left to auto: on a partition without GPU gres it asks for none and runs on the CPU.
    sweep = (*COMMON[:1], *COMMON[2:], "strategy=one_device", "cluster=1x1", "trainer.steps=10", "recipe.optimizer.lr=0.05,0.1")
    proc = dlaunch("-m", *SLURM, *sweep, f"hydra.sweep.dir={tmp_path / 'slurm'}", cwd=tmp_path, timeout=280, device=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"gres         none: cluster.device=auto and partition {PARTITION} has no GPU gres" in proc.stdout
    assert "jobs         2, as one sbatch job array" in proc.stdout

    local = dlaunch("-m", *sweep, f"hydra.sweep.dir={tmp_path / 'local'}", cwd=tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    for job in ("0", "1"):
        there, here = tmp_path / "slurm" / job, tmp_path / "local" / job
        assert summary(there)["status"] == summary(here)["status"] == "completed"
        assert summary(there)["final_loss"] == summary(here)["final_loss"]
        assert _same(params(there), params(here))
    assert not _same(params(tmp_path / "slurm" / "0"), params(tmp_path / "slurm" / "1"))  # the two lrs did differ


def _refused(tmp_path, *overrides: str) -> str:
    proc = dlaunch("hydra/launcher=submitit_slurm", "strategy=mirrored", "cluster=1x2", "trainer.steps=5", *overrides,
                   f"hydra.sweep.dir={tmp_path / 'refused'}", cwd=tmp_path, device=None)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) <= 15, proc.stderr
    assert "dlaunch: SLURM refused the job (nothing was submitted)" in proc.stderr
    return proc.stderr


def test_a_missing_partition_is_one_screen_naming_the_override(tmp_path, slurm):
    err = _refused(tmp_path, "hydra.launcher.partition=nope", "cluster.device=cpu")
    assert "asked:       partition=nope nodes=1 tasks_per_node=1 cpus_per_task=2 timeout_min=60" in err
    assert "SLURM said:  sbatch: error: invalid partition specified: nope" in err
    assert "change:      hydra.launcher.partition" in err


def test_a_gres_the_cluster_lacks_is_one_screen_naming_the_override(tmp_path, slurm):
    err = _refused(tmp_path, *SLURM[1:], "cluster.device=cuda")
    assert "gpus_per_node=2" in err and "Invalid generic resource (gres) specification" in err
    assert "change:      cluster.device=cpu, or hydra.launcher.partition=" in err


def test_a_job_no_node_can_hold_is_refused_instead_of_queued_for_ever(tmp_path, slurm):
    before = _queue()
    proc = dlaunch(*SLURM, "strategy=mirrored", "cluster=2x1", cwd=tmp_path)  # sbatch would accept it: it would pend for ever
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"partition {PARTITION} has 1 node(s) (sinfo) and cluster 2x1 needs 2" in proc.stderr
    assert _queue() == before


def _queue() -> str:
    return subprocess.run(["squeue", "--noheader", "--format=%i"], capture_output=True, text=True).stdout


def test_auto_asks_the_partition_and_a_dry_run_shows_the_request_without_submitting(tmp_path, slurm):
    before = _queue()
    proc = dlaunch(*SLURM, "strategy=mirrored", "cluster=1x2", "launch.dry_run=true", cwd=tmp_path, device=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for row in (f"partition    {PARTITION}", "nodes        1", "tasks        1 per node: one dlaunch node each, starting 2 worker(s)",
                "cpus         2 per task", f"gres         none: cluster.device=auto and partition {PARTITION} has no GPU gres",
                "time         60 min (hydra.launcher.timeout_min)", "dlaunch plan (dry run", "(cpu)",
                "launch.dry_run=true: nothing was submitted"):
        assert row in out, out
    assert _queue() == before
