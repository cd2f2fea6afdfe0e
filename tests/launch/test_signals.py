"""Preemption: SIGINT, SIGTERM and SIGHUP save a checkpoint, stop every worker well within the grace period, exit 128+N."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from launcher.checkpoint import layout
from tests.conftest import process_state, summary
from tests.launch.test_restarts import COMMON, STARTUP_S, finish, logged_steps, run_processes, start, wait_for, worker_pids

pytestmark = pytest.mark.slow
LONG = ("trainer.steps=100000", "trainer.checkpoint.every_steps=100000", "+recipe.step_sleep=0.05")


def stop_with(run_dir, signum, *args, in_process=False, within=30):
    """Start a long run, signal dlaunch once training is under way; (exit code, seconds until no worker is left, output).
    ``within``: the seconds after the signal by which every process must have ended."""
    proc = start(run_dir, *LONG, *args)
    try:
        wait_for(lambda: max(logged_steps(run_dir), default=0) >= 3 and (in_process or worker_pids(run_dir)), STARTUP_S, "training")
        sent = time.monotonic()
        proc.send_signal(signum)
        wait_for(lambda: not run_processes(run_dir) and proc.poll() is not None, within, "every process to end (no orphans)")
        gone = time.monotonic() - sent
    finally:
        out = finish(proc, timeout=30)
    return proc.returncode, gone, out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_signal_saves_a_checkpoint_and_stops_every_worker(tmp_path, signum):
    run_dir = tmp_path / "run"
    code, gone, out = stop_with(run_dir, signum)
    assert code == 128 + signum, out[-3000:]
    # saved and stopped: seconds idle, 10.8 s once under a CPU hog; torch elastic's own close would wait 30 s
    assert gone < 20, f"workers still alive {gone:.1f} s after {signal.Signals(signum).name}"
    saved = layout.latest(run_dir / "checkpoints")
    assert saved is not None, out[-3000:]
    assert layout.read_manifest(saved)["step"] >= 3
    summary = json.loads((run_dir / "summary.json").read_text())  # `dlaunch report` marks the run stopped, not failed
    assert (summary["status"], summary["stopped_by"], summary["exit_code"]) == ("stopped", signal.Signals(signum).name, 128 + signum)
    assert (summary["checkpoint"], summary["checkpoint_step"]) == (str(saved), layout.step_of(saved))
    assert 0 < summary["wall_seconds"] < 300  # from the workers' start to the stop, as a sweep's `wall s` shows it


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_signal_to_dlaunchs_whole_process_group_saves_before_anything_ends(tmp_path, signum):
    """`timeout`, `kill -TERM -PGID`, a scheduler preempting a job step: every process gets it, the warm forkserver
    too. The server stays until dlaunch ends, so the workers it forked save the step they stop after."""
    from tests.conftest import popen

    run_dir = tmp_path / "run"
    proc = popen(*COMMON, "strategy=mirrored", "cluster=1x2", *LONG, f"hydra.run.dir={run_dir}", cwd=tmp_path, session=True)
    try:
        wait_for(lambda: max(logged_steps(run_dir), default=0) >= 3, STARTUP_S, "training")
        os.killpg(proc.pid, signum)
        wait_for(lambda: proc.poll() is not None, 60, "dlaunch to end")
    finally:
        out = finish(proc, timeout=30)
    assert proc.returncode == 128 + signum, out[-3000:]
    saved = layout.latest(run_dir / "checkpoints")
    assert saved is not None and layout.read_manifest(saved)["step"] >= 3, out[-3000:]  # periodic saves: never
    assert not list((run_dir / "checkpoints").glob(".step-*.partial")), out[-3000:]
    wait_for(lambda: not _alive_in_group(proc.pid), 10, "every process of the group to end (no orphans)")


def _alive_in_group(pgid: int) -> bool:
    """A process of the group that is not a zombie (where nothing reaps an orphan, one stays in the table)."""
    states = (process_state(int(p.name)) for p in Path("/proc").glob("[0-9]*"))
    return any(state is not None and state[2] == pgid and state[0] != "Z" for state in states)


def sigterm_to_the_workers_at(run_dir, step, *args):
    """A mirrored 1x2 run sent SIGTERM, its workers alone (not dlaunch), once step ``step`` is logged; (proc, output)."""
    proc = start(run_dir, *args)
    try:
        wait_for(lambda: max(logged_steps(run_dir), default=0) >= step and len(worker_pids(run_dir)) == 2, STARTUP_S,
                 f"step {step}")
        for pid in worker_pids(run_dir).values():
            os.kill(pid, signal.SIGTERM)
        wait_for(lambda: proc.poll() is not None, 60, "dlaunch to end")
    finally:
        out = finish(proc, timeout=30)
    return proc, out


@pytest.mark.parametrize("restarts", [0, 2])
def test_a_signal_sent_to_the_workers_alone_is_a_stop_not_a_failure(tmp_path, restarts):
    """A scheduler or a user may signal the workers and not dlaunch: they save and stop together, and dlaunch
    says the run stopped (128 + N, summary status "stopped"), with no root-cause panel. With restarts left, too:
    a stop is no failure to restart (before, it cost a restart and the run trained on)."""
    run_dir = tmp_path / "run"
    proc, out = sigterm_to_the_workers_at(run_dir, 3, *LONG, f"launch.max_restarts={restarts}")
    assert proc.returncode == 143, out[-3000:]
    assert "root cause" not in out and "SIGTERM reached the workers, not dlaunch" in out, out[-3000:]
    assert f"resume with: dlaunch resume {run_dir}" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["stopped_by"]) == ("stopped", "SIGTERM")
    assert summary["checkpoint_step"] == layout.step_of(layout.latest(run_dir / "checkpoints")) >= 3


def test_a_signal_to_one_worker_in_the_first_step_is_a_stop_with_restarts_left(tmp_path):
    """Rank 0 stops at once inside the command's first step; rank 1 fails on losing it (a consequence). With
    launch.max_restarts the agent took that for a failure and restarted: the run trained on against the stop."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "trainer.steps=6", "+recipe.step_sleep=2", "+recipe.record_attempts=true", "launch.max_restarts=2")
    progress = run_dir / ".dlaunch" / "rank-0.progress.json"

    def in_first_step() -> bool:
        try:
            return json.loads(progress.read_text()).get("operation", "").startswith("train step 1")
        except (OSError, ValueError):
            return False
    try:
        wait_for(in_first_step, STARTUP_S, "rank 0 in its first step")
        os.kill(json.loads(progress.read_text())["pid"], signal.SIGTERM)
        wait_for(lambda: proc.poll() is not None, 60, "dlaunch to end")
    finally:
        out = finish(proc, timeout=30)
    assert proc.returncode == 143, out[-3000:]
    assert "restart 1 of 2" not in out and "root cause" not in out, out[-3000:]
    assert len((run_dir / "attempts-rank0.txt").read_text().split()) == 1  # one start: no restart
    assert summary(run_dir)["status"] == "stopped"


def test_a_signal_during_an_evaluation_stops_after_its_step_and_says_it_waits_for_it(tmp_path):
    """Ctrl-C during a long evaluation: silence until it ended, then one more step trained and a second checkpoint
    saved right after the step's own (step-4 and step-5): the agreement is read one step late."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "trainer.steps=1000", "trainer.eval_every=4", "trainer.checkpoint.every_steps=4",
                 "+recipe.eval_sleep=4")
    progress = run_dir / ".dlaunch" / "rank-0.progress.json"

    def evaluating() -> bool:
        try:
            return json.loads(progress.read_text()).get("operation", "") == "evaluation at step 4"
        except (OSError, ValueError):
            return False
    try:
        wait_for(evaluating, STARTUP_S, "rank 0's evaluation at step 4")
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: proc.poll() is not None, 60, "dlaunch to end")
    finally:
        out = finish(proc, timeout=30)
    assert proc.returncode == 130, out[-3000:]
    assert "SIGINT received: the evaluation at step 4 finishes first, then the ranks stop together" in out, out[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-00000004"], out[-3000:]
    assert summary(run_dir)["checkpoint_step"] == 4


def test_a_stop_whose_save_the_disk_refuses_fails_the_run_and_is_not_restarted(tmp_path, monkeypatch):
    """trainer.checkpoint.on_error=error, launch.max_restarts=1, SIGTERM to the workers: the stop's save failed, the
    message said the run "ends as failed", and the agent restarted it; it trained to the end and exited 0."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("DLAUNCH_TEST_DISK_FULL_AT_STEP", "8+")  # step 7's save lands, every later one is refused
    proc, out = sigterm_to_the_workers_at(run_dir, 8, *LONG[:1], "trainer.checkpoint.every_steps=7", "+recipe.step_sleep=0.5",
                                          "+recipe.record_attempts=true", "launch.max_restarts=1")
    text = " ".join(out.split())
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"StopNotSaved: the checkpoint of step (8|9|1[0-3]) was not saved: No space left on device", text), \
        out[-3000:]
    assert "no restart (launch.max_restarts=1): a stop signal ended the run" in text and "restart 1 of 1" not in text
    assert len((run_dir / "attempts-rank0.txt").read_text().split()) == 1
    assert summary(run_dir)["status"] == "failed" and layout.step_of(layout.latest(run_dir / "checkpoints")) == 7


def test_a_worker_that_ignores_the_signal_is_killed_after_the_grace_period(tmp_path):
    run_dir = tmp_path / "run"
    code, gone, out = stop_with(run_dir, signal.SIGTERM, "+recipe.ignore_signals=true", "launch.stop_grace_s=3")
    assert code == 143, out[-3000:]
    assert 2.5 < gone < 10, f"{gone:.1f} s"
    text = " ".join(out.split())  # it said "all workers were shut down": not which were killed, nor why
    # the first rank killed breaks its peer's collective, which may then exit on that before its own kill; on a loaded
    # machine (CI) a rank may be caught in its loss reduce, or in the stop-signal agreement (where it finds the stop
    # its peer would not agree to), or reading the next batch ahead, rather than its train step
    # and where in its own code, as its heartbeat said (", at train_step (probe_recipe.py:29)")
    doing = (r"rank \d \((train step|loss reduce at step|stop-signal agreement after step|reading ahead after step) \d+"
             r"(, at [^()]+ \([^()]*\))?\)")
    killed = doing + "(, " + doing + ")? did not exit within launch.stop_grace_s=3 s"
    assert re.search(killed + r" of the signal and (was|were) killed \(SIGKILL\)", text), out[-3000:]


def sigterm_with_saves_held(run_dir, *args):
    """A long run whose rank 0 holds any save while RUN_DIR/hold-save is there, sent SIGTERM once it trains."""
    run_dir.mkdir()
    (run_dir / "hold-save").write_text("1")
    proc = start(run_dir, *LONG, "+recipe.hold_saves=true", *args)
    try:
        wait_for(lambda: max(logged_steps(run_dir), default=0) >= 3 and worker_pids(run_dir), STARTUP_S, "training")
    except AssertionError:
        proc.kill()
        proc.wait()
        raise
    proc.send_signal(signal.SIGTERM)
    return proc


def test_a_save_that_outlasts_the_stop_grace_is_killed_said_so_and_its_partial_directory_removed(tmp_path):
    """Rank 0 holds the stop's save past launch.stop_grace_s: the agent kills both ranks; .step-N.partial was left."""
    run_dir = tmp_path / "run"
    proc = sigterm_with_saves_held(run_dir, "launch.stop_grace_s=3")
    try:
        wait_for(lambda: proc.poll() is not None, 30, "dlaunch to end")
    finally:
        out = finish(proc, timeout=30)
    assert proc.returncode == 143, out[-3000:]
    step = int((run_dir / "saving").read_text())
    text = " ".join(out.split())
    # and where the recipe's own code held it, as rank 0's heartbeat said
    assert f"rank 0 (checkpoint save on a stop signal after step {step}, at held_commit (probe_recipe.py:" in text, \
        out[-3000:]
    assert re.search(r"(was|were) killed \(SIGKILL\)", text) and f"(.step-{step:08d}.partial) was removed" in text
    assert not list((run_dir / "checkpoints").glob(".step-*")) and layout.latest(run_dir / "checkpoints") is None
    assert "no checkpoint to resume from" in text


def test_a_save_on_a_stop_signal_gets_the_stop_grace_not_the_failure_grace(tmp_path):
    """A large model's save outlasts launch.shutdown_grace_s (the teardown after a failure); on a stop signal the
    workers have launch.stop_grace_s (25 s) to save. Rank 0 holds its save's commit 4 s, past a 2 s shutdown grace."""
    run_dir = tmp_path / "run"
    proc = sigterm_with_saves_held(run_dir, "launch.shutdown_grace_s=2")
    try:
        wait_for(lambda: (run_dir / "saving").exists(), 90, "the save on the signal")  # 30 s was too few on a slow day
        time.sleep(4)
        (run_dir / "hold-save").unlink()
        wait_for(lambda: proc.poll() is not None, 30, "dlaunch to end")
    finally:
        out = finish(proc, timeout=30)
    assert proc.returncode == 143, out[-3000:]
    saved = layout.latest(run_dir / "checkpoints")
    assert saved is not None and layout.step_of(saved) == int((run_dir / "saving").read_text()), out[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["checkpoint_step"] == layout.step_of(saved)


def test_one_device_in_process_saves_on_sigterm_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    code, gone, out = stop_with(run_dir, signal.SIGTERM, "strategy=one_device", "cluster=1x1", in_process=True)
    assert code == 143, out[-3000:]
    step = layout.read_manifest(layout.latest(run_dir / "checkpoints"))["step"]
    assert json.loads((run_dir / "summary.json").read_text())["checkpoint_step"] == step
    out = finish(start(run_dir, "strategy=one_device", "cluster=1x1", f"trainer.steps={step + 3}"))
    assert f"from step {step}" in out
    assert logged_steps(run_dir) == list(range(1, step + 4))


def test_central_storage_in_process_saves_on_sigterm_and_resumes(tmp_path):
    """Two replica threads in the one dlaunch process: the signal stops both at the same step."""
    run_dir = tmp_path / "run"
    args = ("strategy=central_storage", "strategy.compute_devices=[cpu:0,cpu:1]")
    code, gone, out = stop_with(run_dir, signal.SIGTERM, *args, in_process=True)
    assert code == 143, out[-3000:]
    assert "processes      1 (this process)" in out
    step = layout.read_manifest(layout.latest(run_dir / "checkpoints"))["step"]
    out = finish(start(run_dir, *args, f"trainer.steps={step + 3}"))
    assert f"from step {step}" in out
    assert logged_steps(run_dir) == list(range(1, step + 4))


def test_emulated_nodes_stop_on_sigterm_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # two node agents, each with its rank, forward the stop: 20.7 s on a slow day and over 30 s under five test
    # streams on two cores, so the time is only a guard against a hang; the message tells a clean stop from a kill
    code, _, out = stop_with(run_dir, signal.SIGTERM, "strategy=mirrored", "cluster=2x1", "launch.stop_grace_s=60", within=90)
    assert code == 143, out[-3000:]
    assert "did not exit within" not in " ".join(out.split()), out[-3000:]  # no rank outlasted the stop grace
    assert layout.latest(run_dir / "checkpoints") is not None


def test_sigterm_while_an_in_process_run_builds_is_a_stop_with_its_summary(tmp_path):
    """SIGTERM before the training loop handles it (one_device trains in dlaunch's own process): dlaunch died by the
    signal's default action, with no word and no summary; a Ctrl-C there was already a stop (exit 130)."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "strategy=one_device", "cluster=1x1", "trainer.steps=5", "+recipe.build_sleep=5")
    try:
        wait_for(lambda: (run_dir / "config.yaml").exists(), STARTUP_S, "the run to start building")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
    finally:
        out = finish(proc, timeout=60)
    assert proc.returncode == 143, out[-3000:]
    assert "stopped by SIGTERM" in out and "Traceback" not in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["stopped_by"], summary["exit_code"]) == ("stopped", "SIGTERM", 143)


def test_a_stop_with_checkpoints_off_says_it_saves_nothing(tmp_path):
    """The stop's warning said "then save" where nothing would be saved (no trainer.checkpoint.every_steps)."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "trainer.steps=100000", "trainer.checkpoint.every_steps=0", "+recipe.step_sleep=0.05",
                 "strategy=one_device", "cluster=1x1")
    try:
        wait_for(lambda: max(logged_steps(run_dir), default=0) >= 3, STARTUP_S, "training")
        proc.send_signal(signal.SIGTERM)
    finally:
        out = finish(proc, timeout=60)
    assert proc.returncode == 143, out[-3000:]
    assert "SIGTERM received: the ranks stop together within a step, and save nothing (checkpoints are off)" in out
    assert "then save" not in out and layout.latest(run_dir / "checkpoints") is None


LATE_RANK_SCRIPT = """\
import time, torch, torch.distributed as dist
t = torch.ones(1); dist.all_reduce(t)
if dist.get_rank() == 1:
    time.sleep(10_000)  # a big eval file, written after the last collective
"""


@pytest.mark.parametrize("layout_", [("strategy=mirrored", "cluster=1x2"), ("strategy=multi_worker_mirrored", "cluster=2x1")],
                         ids=["one node", "two emulated nodes"])
def test_a_rank_still_running_after_the_others_finished_is_named_and_a_stop_then_is_a_stop(tmp_path, layout_):
    """Rank 0 finished its script (and wrote summary.json "completed") while rank 1 still ran outside any collective:
    dlaunch waited with no word for as long as it took, and a SIGTERM then left the summary "completed". Now the wait
    is said every launch.collective_timeout_s, naming the rank, and the stop is recorded as one. On two emulated
    nodes, node 0 also said its own node-level line each period: the rank's line alone is said now."""
    (tmp_path / "late.py").write_text(LATE_RANK_SCRIPT)
    run_dir = tmp_path / "run"
    proc = start(run_dir, "script=late.py", *layout_, "cluster.device=cpu", "launch.collective_timeout_s=2", common=())
    try:
        log = run_dir / "dlaunch.log"  # three periods: node 0's own line, where it was said, came in each
        wait_for(lambda: (log.read_text() if log.exists() else "").count("waiting on rank 1") >= 3, STARTUP_S, "three waiting lines")
    finally:
        proc.send_signal(signal.SIGTERM)  # waited on or not, rank 1 sleeps until stopped
        out = finish(proc)
    assert proc.returncode == 143, out[-3000:]
    assert re.search(r"rank 0 finished; waiting on rank 1 \(pid \d+, host [^)]+\) for \d+ s", out), out[-3000:]
    assert "waiting on the other nodes" not in out, out[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped", out[-3000:]
