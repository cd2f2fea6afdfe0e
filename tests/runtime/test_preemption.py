"""Stop signals in a worker: the flag a handler sets, and what it logs."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

from launcher.runtime.preemption import StopRequests


def test_a_second_signal_arriving_inside_the_first_ones_log_call_logs_nothing():
    """A rank gets the terminal's SIGINT and its agent's SIGTERM at once: the second handler ran inside the first
    one's write to dlaunch.log, and logging it again re-entered the file's writer ("--- Logging error ---")."""
    stop = StopRequests(distributed=False)
    said: list[str] = []

    class SecondSignalMidWrite(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())
            if len(said) == 1:
                stop._handler(signal.SIGTERM, None)  # what the interpreter does when the signal lands here

    handler = SecondSignalMidWrite()
    logger = logging.getLogger("dlaunch")
    logger.addHandler(handler)
    try:
        stop._handler(signal.SIGINT, None)
    finally:
        logger.removeHandler(handler)
    assert said == ["SIGINT received: the ranks stop together within a step, then save"]
    assert stop.agreed() == signal.SIGINT


def test_a_stop_elsewhere_in_the_job_is_agreed_as_if_received_here():
    requested = []
    stop = StopRequests(distributed=False, elsewhere=lambda: requested[0] if requested else 0)
    assert stop.agreed() == 0
    requested.append(signal.SIGTERM)
    assert stop.agreed() == signal.SIGTERM


def test_settle_waits_for_the_agreement_in_flight_and_the_next_step_still_reads_it(tmp_path):
    """The loop settles the stop agreement before the profiler's window ends: an all-reduce still running on gloo's
    thread carries the profiler's thread state there and recorded into it while torch stopped it (a corrupted heap,
    3 aborts in 72 two-process profiled runs)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        stop = StopRequests(distributed=True)
        stop._handler(signal.SIGTERM, None)
        assert stop.agreed() == 0  # one step late: step N's flag is launched now, read after step N+1
        work = stop._pending[0]
        stop.settle()
        assert work.is_completed() and stop._pending[0] is work  # done, and still the next step's to read
        assert stop.agreed() == signal.SIGTERM
        stop.settle()
    finally:
        dist.destroy_process_group()


def test_after_an_evaluation_or_a_save_the_flags_are_agreed_now_not_one_step_late(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        stop = StopRequests(distributed=True)
        assert stop.agreed() == 0  # step 1's flags, read after step 2
        with stop.during("the evaluation at step 2"):
            stop._handler(signal.SIGTERM, None)
        assert stop.agreed(now=True) == signal.SIGTERM and stop._pending is None  # after step 2 itself
        stop.settle()
    finally:
        dist.destroy_process_group()


def test_a_process_forked_inside_ignores_the_stop_its_rank_handles():
    """A loader's workers are forked from the rank with its handler, and a Ctrl-C reaches the whole process group:
    each worker logged "SIGINT received ... then save" again (three lines per rank with input.num_workers=2) and
    noted a stop it never acts on. The rank stops them; they ignore it."""
    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logger, handler = logging.getLogger("dlaunch"), Said()
    logger.addHandler(handler)
    try:
        with StopRequests(distributed=False) as stop:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.kill(os.getpid(), signal.SIGINT)
                os.write(write, f"{stop.signum} {len(said)}".encode())
                os._exit(0)
            os.close(write)
            child = os.read(read, 64).decode()
            os.waitpid(pid, 0)
            assert child == "0 0" and stop.signum == 0 and said == []
            pid = os.fork()
            if pid == 0:  # SIGTERM still ends such a process, as a rank's Process.terminate() means it to
                os.kill(os.getpid(), signal.SIGTERM)
                os._exit(0)
            assert os.waitpid(pid, 0)[1] == signal.SIGTERM  # killed by it, not exited
            os.kill(os.getpid(), signal.SIGINT)  # the rank itself still notes and says it
            assert stop.signum == signal.SIGINT
    finally:
        logger.removeHandler(handler)
    assert said == ["SIGINT received: the ranks stop together within a step, then save"]


def test_a_signal_inside_the_first_step_raises_at_once_and_after_it_or_in_the_last_step_waits_for_the_step():
    """The training loop's first step may compile for minutes; nothing in it could be saved: the stop is at once.
    After the step (its evaluation, its checkpoint's save and commit) a stop waits, as in any step, so a save in
    flight is not cut short; a signal in the command's last step lets the run complete."""
    from launcher.runtime.preemption import StoppedEarly

    stop = StopRequests(distributed=False)
    with pytest.raises(StoppedEarly) as raised, stop.at_once_inside(True):
        stop._handler(signal.SIGINT, None)
    assert raised.value.signum == signal.SIGINT and isinstance(raised.value, KeyboardInterrupt)
    for armed in (True, False):  # after the first step; inside a first step that is also the last
        stop = StopRequests(distributed=False)
        with stop.at_once_inside(armed):
            if not armed:
                stop._handler(signal.SIGTERM, None)
        if armed:
            stop._handler(signal.SIGTERM, None)  # flagged: the ranks stop after the step's save
        assert stop.agreed() == signal.SIGTERM
    torn_down = StopRequests(distributed=False, torn_down=lambda: True)
    with torn_down.at_once_inside(True):
        torn_down._handler(signal.SIGTERM, None)  # a failure's teardown is not a stop the user asked for: as before


@pytest.mark.slow
def test_a_stop_in_the_first_step_ends_the_ranks_at_once_not_after_the_grace(tmp_path):
    """Ctrl-C while a compiled run's first step compiled (about 50 s) waited launch.stop_grace_s, then killed the ranks
    (SIGKILL) with a message about a rank that traps the signal. A step of 600 s stands for the compile here."""
    import subprocess

    from launcher.runtime import outputs
    from tests.conftest import PROBE, command
    from tests.launch.test_restarts import STARTUP_S, finish, wait_for

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command(f"recipe.entry={PROBE}", "+recipe.step_sleep=600", "trainer.steps=3", "strategy=mirrored",
                                    "cluster=1x2", "trainer.checkpoint.every_steps=1", "launch.stop_grace_s=400",
                                    f"hydra.run.dir={run_dir}"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: all(outputs.read_progress(run_dir, r).get("operation") == "train step 1" for r in (0, 1)),
                 STARTUP_S, "both ranks in step 1")
        proc.send_signal(signal.SIGINT)
    finally:
        out = finish(proc, timeout=300)  # under the grace: a stop that waited for the step would time out here
    text = " ".join(out.split())
    assert proc.returncode == 130, out[-3000:]
    assert "stopped by SIGINT in step 1, before it completed: nothing new to save" in text, out[-3000:]
    assert "did not exit within" not in text and "Traceback" not in text, out[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped"


@pytest.mark.slow
def test_a_stop_while_the_first_steps_checkpoint_commits_keeps_it(tmp_path):
    """Only the first step itself stops at once: a stop during its save (or evaluation) waits for it, as in any step,
    and the save is kept (an early stop there raised inside torch's checkpoint writer and lost it)."""
    import subprocess

    from tests.conftest import PROBE, command
    from tests.launch.test_restarts import STARTUP_S, finish, wait_for

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "hold-save").write_text("1")
    proc = subprocess.Popen(command(f"recipe.entry={PROBE}", "+recipe.hold_saves=true", "trainer.steps=3",
                                    "strategy=mirrored", "cluster=1x2", "trainer.checkpoint.every_steps=1",
                                    f"hydra.run.dir={run_dir}"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (run_dir / "saving").exists(), STARTUP_S, "rank 0 to hold step 1's save")
        proc.send_signal(signal.SIGINT)
        (run_dir / "hold-save").unlink()
    finally:
        out = finish(proc, timeout=300)
    text = " ".join(out.split())
    assert proc.returncode == 130, out[-3000:]
    assert f"checkpoint: step 1 saved to {run_dir / 'checkpoints' / 'step-00000001'}" in text, out[-3000:]
    assert "before it completed" not in text and "Traceback" not in text, out[-3000:]
    saved = json.loads((run_dir / "summary.json").read_text())["checkpoint_step"]  # the agreement is read a step late
    assert saved in (1, 2) and f"stopped (exit 130); checkpoint {run_dir / 'checkpoints'}/step-0000000{saved}" in text
