"""A stop signal while a sweep's jobs run in other processes (launcher/cli/sweep_stop.py): joblib's workers here;
submitit's tasks take the same path (``main._stop_handling`` chooses it for every launcher but Hydra's basic one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from launcher.cli import sweep_stop
from tests.conftest import PROBE, command
from tests.launch.test_restarts import logged_steps, wait_for

pytestmark = pytest.mark.slow


def test_a_sigterm_to_a_joblib_sweep_stops_its_running_jobs_starts_no_more_and_shows_the_table(tmp_path):
    """dlaunch ended at once without a word (SIGTERM's default action in the parent): no table, no resume hint, and
    the job joblib had not started yet was started by nobody and recorded by nobody."""
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(
        command("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "strategy=one_device", "cluster=1x1",
                f"recipe.entry={PROBE}", "+recipe.step_sleep=0.05", "trainer.steps=2000", "trainer.log_every=1",
                "trainer.checkpoint.every_steps=5", "trainer.seed=1,2,3", f"hydra.sweep.dir={sweep}"),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(lambda: all(len(logged_steps(sweep / job)) >= 3 for job in ("0", "1")), 180, "jobs 0 and 1 to train")
        os.killpg(proc.pid, signal.SIGTERM)  # as timeout(1) or a scheduler sends it: dlaunch and its jobs' processes
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = " ".join(out.split())
    assert proc.returncode == 143, out[-3000:]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["stopped", "stopped", "not started"], out[-3000:]
    # Whichever worker took job 2 tells why: the sweep's marker, or the job its process ran before and saw stopped
    assert jobs[2]["error"] in ("SIGTERM came while the sweep's jobs ran, which stopped the sweep",
                                "job 0 was stopped by SIGTERM, which stopped the sweep",
                                "job 1 was stopped by SIGTERM, which stopped the sweep"), jobs[2]
    assert "sweep summary: 3 jobs" in text and f"go on with: dlaunch resume {sweep}" in text, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_a_job_that_starts_after_the_stop_is_told_why_and_a_new_sweep_starts_clean(tmp_path):
    assert sweep_stop.stopped_before(tmp_path) is None
    (tmp_path / ".dlaunch").mkdir()
    (tmp_path / ".dlaunch" / sweep_stop.MARKER).write_text("SIGTERM came while the sweep's jobs ran\n")
    assert sweep_stop.stopped_before(tmp_path) == "SIGTERM came while the sweep's jobs ran"
    sweep_stop.started(tmp_path)  # the same directory swept again: the earlier stop is not this sweep's
    assert sweep_stop.stopped_before(tmp_path) is None


@pytest.fixture
def default_stops():
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local", "submitit_slurm"])
def test_dlaunch_notes_a_stop_while_any_other_launcher_runs_the_jobs_and_marks_the_sweep_stopped(tmp_path, launcher,
                                                                                                default_stops):
    """SLURM cannot run here: its parent takes the same path as joblib's, chosen by the launcher named."""
    import time

    from launcher.cli import interrupts, main, scheduled

    overrides = [f"hydra/launcher={launcher}"]
    with main._stop_handling(True, overrides, scheduled.launcher_of(overrides)):
        sweep_stop.started(tmp_path)  # Hydra starts the sweep
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert sweep_stop.taken() == signal.SIGTERM  # noted, not SIGTERM's default action
        assert sweep_stop.stopped_before(tmp_path) == "SIGTERM came while the sweep's jobs ran"
        with pytest.raises(interrupts.Stopped):  # a job getting ready in this process (joblib's n_jobs=1) stops there
            sweep_stop.raise_taken()
        with pytest.raises(interrupts.Stopped):  # a second one: at once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and sweep_stop.taken() is None  # the next command's


SIGTERM_AT_JOB_0 = """
import os, signal
from hydra.experimental.callback import Callback

class SigtermAtJob0(Callback):
    def on_job_start(self, config, **kwargs):
        if config.hydra.job.num != 0:
            return
        from launcher.cli import sweep_jobs

        show_plan = sweep_jobs.show_plan

        def showing(*args, **kwargs):  # job 0 gets ready: its checkpoints verified, its plan shown
            os.kill(os.getpid(), signal.SIGTERM)
            return show_plan(*args, **kwargs)

        sweep_jobs.show_plan = showing
"""


def test_joblib_with_one_job_at_a_time_runs_them_in_dlaunchs_process_and_stops_there_too(tmp_path):
    """joblib's n_jobs=1 runs the jobs one after the other in dlaunch's own process, under the stop handling of a
    sweep whose jobs run elsewhere: the job getting ready stops once its record is whole, the next does not start."""
    from tests.conftest import dlaunch, importable_from

    (tmp_path / "sigterm_at_job_0.py").write_text(SIGTERM_AT_JOB_0)
    sweep = tmp_path / "sweep"
    proc = dlaunch("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=1", "trainer.steps=3", "trainer.seed=1,2",
                   "+hydra.callbacks.term._target_=sigterm_at_job_0.SigtermAtJob0", f"hydra.sweep.dir={sweep}", cwd=tmp_path,
                   env=importable_from(tmp_path))
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 143, out[-3000:]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["stopped", "not started"], out[-3000:]
    assert "stopped by SIGTERM before the workers started" in out and f"go on with: dlaunch resume {sweep}" in out
