"""Elastic restarts: a killed worker costs one restart and no step; a hopeless one is tried N+1 times.

The kill points are drawn at random (the seed is in the test id) and each must
give a run bitwise equal to one that was never interrupted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from launcher.checkpoint import layout, read_tensors
from tests.conftest import PROBE, alive, popen, summary, with_overrides

pytestmark = pytest.mark.slow
COMMON = (f"recipe.entry={PROBE}", "recipe.examples=640", "trainer.steps=30", "trainer.log_every=1",
          "trainer.checkpoint.every_steps=4")
MIRRORED = ("strategy=mirrored", "cluster=1x2")
_DRAW = random.Random(20261122)
KILLS = [("mirrored", k) for k in _DRAW.sample(range(3, 28), 2)] + [  # steps 21, 19; then 10 and 23: 1 to 3 past a save
    ("multi_worker_mirrored", _DRAW.randrange(3, 28)), ("one_device", _DRAW.randrange(3, 28))]
SHAPES = {"mirrored": ("strategy=mirrored", "cluster=1x2"), "multi_worker_mirrored": ("strategy=multi_worker_mirrored", "cluster=1x2"),
          "one_device": ("strategy=one_device", "cluster=1x1")}


def start(run_dir: Path, *args: str, common: tuple[str, ...] = COMMON):
    """dlaunch with ``common`` (the probe recipe's) and ``args`` (mirrored 1x2 unless ``args`` name a strategy), left
    running: the console script's path, local CPU workers forked from its warm forkserver (``conftest.popen``)."""
    shape = () if any(a.startswith("strategy=") for a in args) else MIRRORED
    return popen(*with_overrides((*common, *shape, *args), f"hydra.run.dir={run_dir}"), cwd=run_dir.parent)  # before a `--`


def logged_steps(run_dir: Path) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    except (OSError, ValueError):
        return []


def run_processes(run_dir: Path) -> list[int]:
    """Live processes started for this run: node agents and fresh workers (the run's job file is on their command
    line), and whatever works in the run's parent directory, where the suite starts each run (dlaunch, its warm
    forkserver and the workers forked from it). Not multiprocessing's resource tracker: it leaves by itself once the
    last process that shared it has gone (it reads to the end of its pipe), a moment after dlaunch. Nor a process
    already exiting: its memory, and with it its command line, is gone (once in 6 runs, one was still found so)."""
    found, marker, here = [], str(run_dir / ".dlaunch").encode(), str(run_dir.parent)
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if not cmdline or b"multiprocessing.resource_tracker" in cmdline:
                continue
            if marker in cmdline or os.readlink(proc / "cwd") in (here, str(run_dir)):
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of this run's live worker processes, from the pid each rank's heartbeat keeps in its progress file
    (``RUN_DIR/.dlaunch/rank-R.progress.json``, about once a second)."""
    found = {}
    for path in (run_dir / ".dlaunch").glob("rank-*.progress.json"):
        try:
            record = json.loads(path.read_text())
            pid, rank = int(record["pid"]), int(record["rank"])
        except (OSError, ValueError, KeyError):  # being written, or gone
            continue
        if alive(pid):
            found[rank] = pid
    return found


# How long a run may take to start training: only a guard against one that never does. Two emulated nodes in fresh
# interpreters took over 120 s under five test streams and a CPU hog on two cores.
STARTUP_S = 240


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` (often a scan of /proc) ten times a second: faster polls took CPU from the run awaited."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


_straight: dict[str, tuple] = {}


def uninterrupted(strategy: str, tmp_path_factory) -> tuple[dict, dict]:
    """The final parameters and last metrics record of a run that nothing interrupts (once per strategy)."""
    if strategy not in _straight:
        run_dir = tmp_path_factory.mktemp(f"straight-{strategy}") / "run"
        out = finish(start(run_dir, *SHAPES[strategy]))
        assert summary(run_dir)["status"] == "completed", out[-3000:]
        last = json.loads([line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line][-1])
        _straight[strategy] = (read_tensors(layout.latest(run_dir / "checkpoints")), last)
    return _straight[strategy]


@pytest.mark.parametrize("strategy,kill_at", KILLS, ids=[f"{s}-kill-at-step-{k}" for s, k in KILLS])
def test_sigkill_of_a_worker_restarts_once_from_the_last_checkpoint(tmp_path, tmp_path_factory, strategy, kill_at):
    run_dir = tmp_path / "run"
    victim = random.Random(kill_at).choice([0, 1] if strategy != "one_device" else [0])
    # The victim pauses inside step kill_at on its first attempt and is killed there: a kill timed by the logged
    # steps could land after the last step on a busy machine (it did once: the run completed with no restart).
    proc = start(run_dir, *SHAPES[strategy], "launch.max_restarts=2", f"+recipe.pause_replica={victim}",
                 f"+recipe.pause_step={kill_at}", "+recipe.record_attempts=true")
    try:
        paused = run_dir / f"paused-replica{victim}"
        wait_for(lambda: paused.exists() and paused.read_text().strip(), STARTUP_S, f"replica {victim} to pause in step {kill_at}")
        os.kill(int(paused.read_text()), signal.SIGKILL)  # the paused worker's own pid
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    s = summary(run_dir)
    assert s["status"] == "completed" and s["restarts"] == 1
    assert len((run_dir / "attempts-rank0.txt").read_text().split()) == 2, "exactly one restart"
    assert logged_steps(run_dir) == list(range(1, 31)), "no step lost or doubled"
    params, last = uninterrupted(strategy, tmp_path_factory)
    got = read_tensors(layout.latest(run_dir / "checkpoints"))
    assert all(torch.equal(params[k], got[k]) for k in params), f"rank {victim} killed at step {kill_at}"
    assert json.loads([line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line][-1])["loss"] == last["loss"]
    assert run_processes(run_dir) == []


def test_a_restart_after_retention_removed_the_checkpoint_the_command_resumed_from(tmp_path):
    # the command resumes from step 4; with keep=1 the saves of steps 6 and 8 remove it; rank 1 is killed in its
    # 5th step (step 9) and the restart resumes from step 8 (its 5th step would be step 13: the run ends first)
    run_dir = tmp_path / "run"
    keep = ("trainer.checkpoint.every_steps=2", "trainer.checkpoint.keep=1")
    assert finish(start(run_dir, *keep, "trainer.steps=4")) and summary(run_dir)["status"] == "completed"
    out = finish(start(run_dir, *keep, "trainer.steps=12", "launch.max_restarts=1", "+recipe.kill_replica=1",
                       "+recipe.kill_step=5"))
    s = summary(run_dir)
    assert s["status"] == "completed" and s["restarts"] == 1, out[-3000:]
    assert s["history"] == {"commands": 2, "restarts": 1, "resumes": 2}
    assert logged_steps(run_dir) == list(range(1, 13))
    assert run_processes(run_dir) == []


def test_a_worker_that_always_fails_is_tried_n_plus_one_times(tmp_path):
    run_dir = tmp_path / "run"
    out = finish(start(run_dir, "launch.max_restarts=2", "+recipe.fail_replica=1", "+recipe.fail_step=2",
                       "+recipe.record_attempts=true"))
    assert len((run_dir / "attempts-rank1.txt").read_text().split()) == 3, out[-4000:]
    assert "restarts exhausted" in out and "launch.max_restarts=2" in out, out[-4000:]
    assert out.count("root cause") == 1, out[-4000:]
    # each restart says which rank failed and why, on the terminal and in dlaunch.log
    for n in (1, 2):
        line = "rank 1 failed (exit code 1: RuntimeError: "
        assert f"restart {n} of 2 (launch.max_restarts)" in out and out.count(line) >= 2, out[-4000:]
        assert f"restart {n} of 2" in (run_dir / "dlaunch.log").read_text()
    failed = summary(run_dir)
    assert (failed["status"], failed["restarts"], failed["history"]["restarts"]) == ("failed", 2, 2)


def test_an_abort_in_teardown_after_completing_is_neither_a_failure_nor_a_restart(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "launch.max_restarts=2", "+recipe.abort_in_teardown=1", "+recipe.record_attempts=true")
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert summary(run_dir)["status"] == "completed"
    assert len((run_dir / "attempts-rank1.txt").read_text().split()) == 1, "nothing was trained twice"
    assert "SIGABRT" in out or "already completed" in out, "the abort did happen"


def test_a_stop_after_the_run_completed_exits_0(tmp_path):
    """A SIGTERM (a scheduler's preemption) while the workers of a completed run still ended exited 143 and said
    `stopped ... resume with`, while summary.json said completed: a scheduler would start the run again for nothing."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "trainer.steps=6", "+recipe.linger=30")
    deadline = time.time() + 120
    while not (run_dir / "all-completed").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    text = " ".join(out.split())
    assert "the SIGTERM came in the run's last step or as its workers ended: the run completed, nothing was cut short" \
        in text, out[-3000:]
    assert "stopped by SIGTERM" not in text, out[-3000:]  # said before, then "completed": two lines that disagreed
    assert summary(run_dir)["status"] == "completed" and "resume with" not in out


def test_a_restart_before_the_first_step_resumes_from_the_checkpoint_the_launcher_chose(tmp_path):
    """A build that fails on the first attempt: the restarted workers must not choose again in a directory that
    still holds another timeline (steps set aside only once training starts). Before, they took its newest step:
    a damaged one the launcher had passed over, or one that trainer.resume=never had refused."""
    from tests.checkpoint.test_integrity import flip_a_bit

    run_dir = tmp_path / "run"
    every = "trainer.checkpoint.every_steps=4"
    assert finish(start(run_dir, every, "trainer.steps=8")) and summary(run_dir)["status"] == "completed"
    flip_a_bit(run_dir / "checkpoints" / "step-00000008")  # same size: only the launcher's sha256 sees it
    flaky = ("launch.max_restarts=1", "+recipe.fail_build_attempts=1")
    out = finish(start(run_dir, every, "trainer.steps=12", *flaky))
    s = summary(run_dir)
    assert s["status"] == "completed" and s["restarts"] == 1, out[-3000:]
    assert "step-00000008 is damaged" in out and "resumed from" in out, out[-3000:]
    assert "step-00000008" not in out.split("resumed from", 1)[1].splitlines()[0], out[-3000:]
    assert logged_steps(run_dir) == list(range(1, 13)), "steps 5-8 trained again from step 4"
    out = finish(start(run_dir, every, "trainer.steps=4", "trainer.resume=never", *flaky))
    assert summary(run_dir)["status"] == "completed" and "resumed from" not in out, out[-3000:]
    assert logged_steps(run_dir) == [1, 2, 3, 4]
    assert run_processes(run_dir) == []
