"""The suite's prewarmed runner (``tests/prewarmed.py``) runs a command as a fresh interpreter would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, alive, command, process_state
from tests.prewarmed import Zygote

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="forks with PR_SET_PDEATHSIG")]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", "OMP_NUM_THREADS": "1"}
RESULT = ("status", "final_loss", "first_loss", "param_norm", "eval_loss", "steps", "strategy", "recipe")


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(str(ROOT), ENV)
    yield z
    z.close()


def fresh(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), cwd=cwd, env=ENV, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("shape", [[], ["strategy=mirrored", "cluster=1x2"]], ids=["one_process", "two_workers"])
def test_a_forked_run_ends_as_a_fresh_one_does(zygote, tmp_path, shape):
    ends = {}
    for how in ("forked", "fresh"):
        args = ["recipe=linear", "trainer.steps=10", "cluster.device=cpu", *shape, f"hydra.run.dir={tmp_path / how}"]
        proc = zygote.run(args, tmp_path, ENV, 240) if how == "forked" else fresh(args, tmp_path)
        assert proc.returncode == 0, proc.stderr
        result = json.loads((tmp_path / how / "summary.json").read_text())
        ends[how] = {k: result.get(k) for k in RESULT}
        assert f"results: {tmp_path / how}" in proc.stdout
    assert ends["forked"] == ends["fresh"] and ends["forked"]["status"] == "completed"


def test_a_config_error_prints_and_exits_as_from_a_fresh_interpreter(zygote, tmp_path):
    args = ["trainer.stepz=3", "cluster.device=cpu"]
    forked, plain = zygote.run(args, tmp_path, ENV, 60), fresh(args, tmp_path)
    assert forked.returncode == plain.returncode == 2
    assert forked.stderr == plain.stderr and "trainer.stepz = 3" in forked.stderr and "Traceback" not in forked.stderr


def test_a_timeout_kills_the_command_and_the_next_one_runs(zygote, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(["recipe=linear", "trainer.steps=100000000", "cluster.device=cpu", f"hydra.run.dir={tmp_path / 'long'}"], tmp_path, ENV, 8)
    proc = zygote.run(["recipe=linear", "trainer.steps=3", "cluster.device=cpu", f"hydra.run.dir={tmp_path / 'next'}"], tmp_path, ENV, 120)
    assert proc.returncode == 0 and json.loads((tmp_path / "next" / "summary.json").read_text())["status"] == "completed"


def test_a_busy_zygote_declines_so_the_caller_runs_fresh(zygote, tmp_path):
    with zygote._busy:  # another thread's command is running
        assert zygote.run(["--cfg", "job"], tmp_path, ENV, 60) is None
    assert zygote.run(["--cfg", "job"], tmp_path, ENV, 60).returncode == 0


def test_a_started_command_is_handled_as_a_popen_is(zygote, tmp_path):
    """``Zygote.start``: a running command that a test signals, polls and reads once it has ended (``conftest.popen``)."""
    run_dir = tmp_path / "long"
    args = ["recipe=linear", "trainer.steps=100000000", "cluster.device=cpu", f"hydra.run.dir={run_dir}"]
    proc = zygote.start(args, tmp_path, ENV, session=True)
    try:
        assert zygote.run(["--cfg", "job"], tmp_path, ENV, 60) is None  # the zygote is the running command's
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.1)
        assert proc.poll() is None and os.getpgid(proc.pid) == proc.pid  # a session, and so a group, of its own
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err is None  # stderr is in stdout, as with stderr=STDOUT
    assert "stopped by SIGTERM after step" in out and "stopped (exit 143)" in out, out[-3000:]
    assert zygote.run(["--cfg", "job"], tmp_path, ENV, 60).returncode == 0  # free again


@pytest.mark.parametrize("threads,forked", [("1", True), ("2", False)], ids=["forked server", "torch loaded otherwise"])
def test_a_commands_warm_server_is_a_fork_of_it_where_torch_loaded_as_the_workers_would(zygote, tmp_path, threads, forked):
    """``warm.prewarm``: the zygote loaded torch with OMP_NUM_THREADS=1, as dlaunch's workers load it, so a command's
    server is the command forked, not a fresh interpreter; with another value the workers need a fresh one. A stop
    of the whole group then ends as it does with a fresh server: no word from the server, nothing left."""
    run_dir = tmp_path / "run"
    args = ["recipe=linear", "strategy=mirrored", "cluster=1x2", "trainer.steps=100000000", "trainer.log_every=100",
            f"hydra.run.dir={run_dir}"]
    proc = zygote.start(args, tmp_path, {**ENV, "OMP_NUM_THREADS": threads}, session=True)
    try:
        deadline = time.monotonic() + 240
        progress = run_dir / ".dlaunch"
        # training, and both ranks' heartbeats written (rank 1's may come after rank 0's first record)
        while not ((run_dir / "metrics.jsonl").exists() and len(list(progress.glob("rank-*.progress.json"))) == 2) \
                and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.1)
        workers = [json.loads(p.read_text())["pid"] for p in progress.glob("rank-*.progress.json")]
        assert len(workers) == 2
        servers = {process_state(pid)[1] for pid in workers}
        assert len(servers) == 1 and process_state(server := servers.pop())[1] == proc.pid
        started_as = Path(f"/proc/{server}/cmdline").read_bytes()
        assert ("multiprocessing.forkserver" not in started_as.decode()) == forked
        assert (started_as == Path(f"/proc/{proc.pid}/cmdline").read_bytes()) == forked
        os.killpg(proc.pid, signal.SIGTERM)  # dlaunch, its server and its workers, as `kill -TERM -PGID` does
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "stopped (exit 143)" in out, out[-3000:]
    assert "stopping before training starts" not in out  # the server took dlaunch's early handler back
    assert not any(alive(pid) for pid in (*workers, server))
