"""A Ctrl-C before the run's own handling: noted, then a clean stop (exit 130, one line, nothing trained)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher.cli import interrupts
from tests.conftest import command


@pytest.fixture
def noted(monkeypatch):
    monkeypatch.setattr(interrupts, "_noted", [])
    monkeypatch.setattr(interrupts, "_before", {})
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    others = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGHUP)}
    yield
    signal.signal(signal.SIGINT, previous)
    for sig, handler in others.items():
        signal.signal(sig, handler)


def test_the_first_ctrl_c_is_noted_the_second_interrupts_and_hand_over_restores(noted):
    interrupts.note_early()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs at the next bytecode: no KeyboardInterrupt from it
    assert interrupts.requested()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert interrupts.hand_over() and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_early_sigterm_is_noted_then_sigterm_raises_a_stop_until_dlaunch_ends(noted, capsys):
    """SIGTERM's default action ended dlaunch without a word wherever nothing else handled it."""
    interrupts.note_early()
    os.kill(os.getpid(), signal.SIGTERM)  # while torch imports: noted, acted on at the safe point
    time.sleep(0.05)
    assert "dlaunch: SIGTERM: stopping before training starts" in capsys.readouterr().err
    assert interrupts.hand_over() == 143 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(interrupts.Stopped) as stopped:  # from there until the run's own handling: raised
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)
    assert stopped.value.exit_code == 129
    interrupts.release()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


def test_where_ctrl_c_is_ignored_it_stays_ignored(noted):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    interrupts.note_early()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and not interrupts.hand_over()


@pytest.mark.parametrize("delay_s", [0.3, 0.8])
def test_a_ctrl_c_in_the_first_second_stops_the_run_cleanly(delay_s, tmp_path):
    """Sent while dlaunch imports torch (whose import of NumPy swallowed the KeyboardInterrupt: the run trained
    on to its end) or reads the config (a traceback from inside a library)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command("strategy=mirrored", "cluster=1x2", "trainer.steps=100000", f"hydra.run.dir={run_dir}"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay_s)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # A machine so busy that the signal came while Python itself was starting (before its handler, or in its site
    # import), or while it imported dlaunch's console script: as a shell's Ctrl-C ends any program then, before it
    # ran a line of dlaunch.
    if proc.returncode == -signal.SIGINT and out == "" or "init_import_site" in out or _before_dlaunch_ran(out):
        assert proc.returncode != 0 and not run_dir.exists(), out[-3000:]
        return
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
    assert not (run_dir / "summary.json").exists() or "completed" not in (run_dir / "summary.json").read_text()


def _before_dlaunch_ran(out: str) -> bool:
    """A KeyboardInterrupt traceback from before ``entry()`` noted Ctrl-C: every frame in dlaunch's code is an import
    (a module's top level, or ``entry()``'s first line, which imports the module that notes it). CI met one at 0.3 s,
    in entry.py's own imports."""
    if not out.rstrip().endswith("KeyboardInterrupt"):
        return False
    first = next(n for n, line in enumerate(Path(interrupts.__file__).with_name("entry.py").read_text().splitlines(), 1)
                 if "from launcher.cli import interrupts" in line)
    frames = re.findall(r'File "([^"]*/launcher/[^"]*)", line (\d+), in (\S+)', out)
    return all(where == "<module>" or (path.endswith("entry.py") and where == "entry" and int(line) == first)
               for path, line, where in frames)


def test_the_early_interrupt_check_tells_an_import_from_a_lost_ctrl_c():
    """The allowance above, on the traceback CI printed (an import of entry.py's) and on one from dlaunch's own code."""
    root = Path(interrupts.__file__).parents[2]
    at_import = (f'Traceback (most recent call last):\n  File "<frozen runpy>", line 198, in _run_module_as_main\n'
                 f'  File "{root}/launcher/cli/entry.py", line 12, in <module>\n    from typing import Callable\n'
                 f'  File "<frozen importlib._bootstrap_external>", line 128, in _path_join\nKeyboardInterrupt\n')
    assert _before_dlaunch_ran(at_import)
    in_main = at_import.replace("line 12, in <module>", "line 30, in entry").replace("KeyboardInterrupt\n", "") + (
        f'  File "{root}/launcher/cli/main.py", line 40, in main\nKeyboardInterrupt\n')
    assert not _before_dlaunch_ran(in_main) and not _before_dlaunch_ran("dlaunch: stopped by Ctrl-C\n")


def test_a_ctrl_c_inside_a_held_block_is_raised_once_the_block_is_done(noted):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.append("the rest of the block")
    assert done and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # asked twice: at once
        with interrupts.held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.append("never")
    assert done == ["the rest of the block"]


def test_a_ctrl_c_while_the_run_is_recorded_stops_it_with_a_whole_record_and_a_summary(noted, tmp_path, monkeypatch, capsys):
    """Between the plan and the launch: the run's record is written whole, and the stop has its summary and a resume
    hint that works (before, it exited 130 with a half-written .hydra/ and no summary.json)."""
    from launcher.cli import run_record
    from launcher.cli.main import main
    from launcher.runtime import outputs

    record = run_record.record_hydra

    def interrupted(run_dir, cfg):
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C in the middle of writing the record
        time.sleep(0.05)
        record(run_dir, cfg)

    monkeypatch.setattr(run_record, "record_hydra", interrupted)
    run_dir = tmp_path / "run"
    assert main(["cluster.device=cpu", "trainer.steps=3", f"hydra.run.dir={run_dir}"]) == 130
    assert "stopped by Ctrl-C before the workers started" in capsys.readouterr().out + (run_dir / "dlaunch.log").read_text()
    assert outputs.read_summary(run_dir)["exit_code"] == 130
    assert {p.name for p in (run_dir / ".hydra").iterdir()} >= {"config.yaml", "hydra.yaml", "overrides.yaml"}
    assert (run_dir / outputs.CONFIG).is_file()


def test_a_sigterm_inside_a_held_block_is_raised_as_a_stop_once_the_block_is_done(noted):
    done = []
    with pytest.raises(interrupts.Stopped) as stopped:
        with interrupts.stops_raise():
            with interrupts.held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                done.append("the rest of the block")
    assert done and stopped.value.exit_code == 143 and str(stopped.value) == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # each handler put back


def test_a_stop_between_a_sweeps_jobs_is_noted_each_launch_gets_the_handling_from_before_the_sweep(noted):
    with interrupts.between_jobs():
        os.kill(os.getpid(), signal.SIGTERM)  # while Hydra sets the next job up: its default action ended dlaunch
        time.sleep(0.05)
        assert interrupts.take_noted() == signal.SIGTERM and interrupts.take_noted() is None
        with interrupts.job_launches():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the job's own handling from here
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            signal.signal(signal.SIGTERM, lambda *_: None)  # as torch elastic's agent leaves its handler behind
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)
        with pytest.raises(interrupts.Stopped) as stopped:
            with interrupts.job_launches():
                interrupts.raise_noted()  # one that came while the job got ready: raised once it launches
        assert stopped.value.exit_code == 129
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        with pytest.raises(interrupts.Stopped):  # a second one stops at once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGINT) is signal.default_int_handler


SIGTERM_AFTER_JOB_0 = """
import os, signal
from hydra.experimental.callback import Callback

class SigtermAfterJob0(Callback):
    def on_job_end(self, config, job_return, **kwargs):
        if config.hydra.job.num == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # after job 0, while Hydra goes on to job 1
"""


def test_a_sigterm_between_a_sweeps_jobs_stops_it_with_its_table_and_resume_hint(tmp_path):
    """It exited 143 without a word: no table, no resume hint, no directory for the next job."""
    from tests.conftest import dlaunch, importable_from

    (tmp_path / "sigterm_between.py").write_text(SIGTERM_AFTER_JOB_0)
    sweep = tmp_path / "sweep"
    proc = dlaunch("-m", "strategy=mirrored", "cluster=1x2", "trainer.steps=3", "trainer.seed=1,2,3",
                   "+hydra.callbacks.term._target_=sigterm_between.SigtermAfterJob0", f"hydra.sweep.dir={sweep}", cwd=tmp_path,
                   env=importable_from(tmp_path))
    assert proc.returncode == 143, proc.stderr[-3000:]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "not started", "not started"]
    assert jobs[1]["error"] == "SIGTERM came between jobs, which stopped the sweep"
    assert json.loads((sweep / "1" / "summary.json").read_text())["status"] == "not started"
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "sweep summary: 3 jobs, 2 not started" in text and f"go on with: dlaunch resume {sweep}" in text


SIGTERM_AT = """
import os, signal
from hydra.experimental.callback import Callback

class SigtermAt(Callback):
    def __init__(self, where, signame="SIGTERM"):
        self.where, self.signum = where, getattr(signal, signame)

    def on_job_start(self, config, **kwargs):
        if self.where == "job start":  # Hydra runs the job: after dlaunch handed Ctrl-C over, before the job
            os.kill(os.getpid(), signal.SIGTERM)
            return
        import launcher.checkpoint as checkpoint

        select = checkpoint.select

        def verifying(spec, run_dir):  # as the checkpoint to resume from is verified (sha256 of every file)
            if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # inherited from a shell's background job: a
                signal.signal(signal.SIGINT, signal.default_int_handler)  # terminal's Ctrl-C is Python's here
            os.kill(os.getpid(), self.signum)
            return select(spec, run_dir)

        checkpoint.select = verifying
"""


@pytest.mark.parametrize("where,signame", [("job start", "SIGTERM"), ("checkpoint verification", "SIGTERM"),
                                           ("checkpoint verification", "SIGINT")])
def test_a_stop_before_a_lone_run_records_itself_says_so_and_exits_128_plus_n(tmp_path, where, signame):
    """Between the end of the early noting and the run's record (its checkpoints verified, its plan shown), SIGTERM
    had its default action: dlaunch ended without a word (exit -15). The run that was there stays as it was. A
    Ctrl-C there was said as `stopped by  before the run started` (a KeyboardInterrupt's text is empty)."""
    from tests.conftest import dlaunch, importable_from, summary

    run_dir = tmp_path / "run"
    first = dlaunch("trainer.steps=4", "trainer.checkpoint.every_steps=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    record = (run_dir / ".hydra" / "overrides.yaml").read_text()
    (tmp_path / "sigterm_at.py").write_text(SIGTERM_AT)
    proc = dlaunch("trainer.steps=8", "trainer.checkpoint.every_steps=2", f"hydra.run.dir={run_dir}",
                   "+hydra.callbacks.term._target_=sigterm_at.SigtermAt", f"+hydra.callbacks.term.where={where}",
                   f"+hydra.callbacks.term.signame={signame}", cwd=tmp_path, env=importable_from(tmp_path))
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 128 + getattr(signal, signame), out[-3000:]
    said = "stopped by SIGTERM before the run started" if where != "job start" else "dlaunch: stopped by SIGTERM"
    said = "stopped by Ctrl-C before the run started: nothing was trained" if signame == "SIGINT" else said
    assert said in out and "Traceback" not in out, out[-3000:]
    assert summary(run_dir)["status"] == "completed" and (run_dir / ".hydra" / "overrides.yaml").read_text() == record
