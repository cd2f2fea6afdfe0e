"""``trainer.profile``: torch.profiler over a window of steps, a trace and an op table per rank.

Real dlaunch runs on the CPU (``cluster.device=cpu``) and real ``torch.profiler`` traces; the unit test
drives ``StepProfiler`` with real torch ops.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from launcher.config.trainer import ProfileSpec
from launcher.runtime.profiling import REGIONS, StepProfiler
from tests.conftest import summary


def events(trace) -> list[dict]:
    return json.loads(trace.read_text())["traceEvents"]


def named(trace, name: str) -> list[dict]:
    return [e for e in events(trace) if e.get("name") == name and e.get("ph") == "X"]


def test_the_window_records_active_steps_with_dlaunchs_regions(tmp_path):
    spec = ProfileSpec(enabled=True, wait=2, warmup=1, active=3)
    a = torch.randn(64, 64)
    with StepProfiler(spec, tmp_path, "rank0", "cpu") as prof:
        for _ in range(8):
            with prof.region("dlaunch.data"):
                b = torch.randn(64, 64)
            with prof.region("dlaunch.step"):
                (a @ b).relu().sum()
            prof.step()
    assert prof.written == tmp_path / "profile" / "rank0.trace.json"
    assert len(named(prof.written, "dlaunch.step")) == 3  # the active steps only: not wait's, not warmup's
    assert len(named(prof.written, "dlaunch.data")) == 3
    assert any(e.get("name") == "aten::mm" for e in events(prof.written))
    table = (tmp_path / "profile" / "rank0-ops.txt").read_text()
    assert table.startswith("trainer.profile: steps 4-6 of this command, rank0, sorted by self_cpu_time_total")
    assert "dlaunch.step" in table and "(1 per step)" in table and "aten::mm" in table


def steps(prof, n: int, fail_at: int | None = None) -> None:
    a = torch.randn(32, 32)
    for i in range(n):
        with prof.region("dlaunch.step"):
            (a @ a).sum()
        if i == fail_at:
            raise RuntimeError("the recipe failed")
        prof.step()


def test_the_profiler_stops_when_the_window_is_recorded(tmp_path):
    with StepProfiler(ProfileSpec(enabled=True, wait=1, warmup=1, active=1), tmp_path, "rank0", "cpu") as prof:
        steps(prof, 3)
        assert prof.written is not None
        assert prof.region("dlaunch.step") is prof.region("dlaunch.data")  # later steps pay nothing
        steps(prof, 2)
    assert len(named(prof.written, "dlaunch.step")) == 1


def test_ending_is_said_before_the_step_that_ends_the_window_and_only_then(tmp_path):
    """The loop settles its collectives in flight when ``ending`` is true (launcher/runtime/loop.py)."""
    said = []
    with StepProfiler(ProfileSpec(enabled=True, wait=1, warmup=1, active=2), tmp_path, "rank0", "cpu") as prof:
        for _ in range(6):
            said.append(prof.ending)
            torch.ones(4).sum()
            prof.step()
    assert said == [False, False, False, True, False, False] and prof.written is not None
    with StepProfiler(ProfileSpec(), tmp_path, "rank0", "cpu") as off:
        assert not off.ending


def test_an_error_inside_the_window_writes_no_partial_trace(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dlaunch"), pytest.raises(RuntimeError, match="the recipe failed"):
        with StepProfiler(ProfileSpec(enabled=True, wait=1, warmup=1, active=3), tmp_path, "rank0", "cpu") as prof:
            steps(prof, 10, fail_at=3)  # the second recorded step
    assert prof.written is None and not (tmp_path / "profile").exists()
    assert "profile" not in caplog.text  # the run's own error is the story


def test_a_trace_that_cannot_be_written_is_a_warning_and_training_goes_on(tmp_path, caplog):
    (tmp_path / "profile").write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="dlaunch"):
        with StepProfiler(ProfileSpec(enabled=True, wait=0, warmup=1, active=1), tmp_path, "rank3", "cpu") as prof:
            steps(prof, 4)
    assert prof.written is None
    assert f"profile: rank3's trace could not be written to {tmp_path / 'profile'}" in caplog.text
    assert "fewer than" not in caplog.text


def test_a_command_shorter_than_the_window_says_so_and_writes_nothing(tmp_path, caplog):
    spec = ProfileSpec(enabled=True, wait=5, warmup=1, active=2)
    with caplog.at_level(logging.WARNING, logger="dlaunch"):
        with StepProfiler(spec, tmp_path, "worker1", "cpu") as prof:
            for _ in range(3):
                torch.ones(4).sum()
                prof.step()
    assert prof.written is None and not (tmp_path / "profile").exists()
    assert "worker1 ran 3 step(s) in this command, fewer than the 8 the window needs" in caplog.text


def test_off_costs_nothing_and_writes_nothing(tmp_path):
    with StepProfiler(ProfileSpec(), tmp_path, "rank0", "cpu") as prof:
        assert prof.region("dlaunch.step") is prof.region("dlaunch.data")  # one shared null context
        prof.step()
    assert not (tmp_path / "profile").exists()


@pytest.mark.slow
@pytest.mark.parametrize("args", [("strategy=one_device",), ("strategy=multi_worker_mirrored", "cluster=1x2")],
                         ids=["one_device", "two_processes"])
def test_every_rank_writes_its_trace_and_rank_0_says_where(run_dlaunch, args):
    proc, run_dir = run_dlaunch("recipe=linear", "trainer.steps=10", "trainer.profile.enabled=true",
                                "trainer.profile.wait=2", "trainer.profile.active=2", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile steps 5-6 of this command to RUN_DIR/profile" in proc.stdout  # the plan's training row
    ranks = 2 if "cluster=1x2" in args else 1
    for rank in range(ranks):
        trace = run_dir / "profile" / f"rank{rank}.trace.json"
        assert len(named(trace, "dlaunch.step")) == 2
        assert "dlaunch regions, host (CPU) time per step:" in (run_dir / "profile" / f"rank{rank}-ops.txt").read_text()
    said = proc.stdout + proc.stderr
    assert said.count("INFO profile: ") == 1 and str(run_dir / "profile" / "rank0.trace.json") in said


@pytest.mark.slow
def test_a_resumed_command_with_fewer_steps_left_than_the_window_warns_and_writes_nothing(run_dlaunch):
    first, run_dir = run_dlaunch("recipe=linear", "trainer.steps=6", "trainer.checkpoint.every_steps=6")
    assert first.returncode == 0, first.stderr[-3000:]
    again, _ = run_dlaunch("recipe=linear", "trainer.steps=20", "trainer.checkpoint.every_steps=6", "trainer.profile.enabled=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 6
    assert "rank0 ran 14 step(s) in this command, fewer than the 15 the window needs" in again.stderr
    assert not (run_dir / "profile").exists()


@pytest.mark.slow
def test_parameter_server_workers_write_their_own_trace(run_dlaunch):
    """The chief's trace is rank0's; a worker's is worker0's. A worker shares the global steps with the chief and
    may start after the chief has run them all: then it says how many it ran instead."""
    proc, run_dir = run_dlaunch("recipe=wide_deep", "strategy=parameter_server", "cluster.workers=1", "cluster.ps=1",
                                "trainer.steps=300", "trainer.log_every=100", "trainer.profile.enabled=true",
                                "trainer.profile.wait=0", "trainer.profile.warmup=1", "trainer.profile.active=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(named(run_dir / "profile" / "rank0.trace.json", "dlaunch.step")) == 1  # the chief
    worker = run_dir / "profile" / "worker0.trace.json"
    if worker.exists():
        assert len(named(worker, "dlaunch.step")) == 1
    else:
        assert re.search(r"\[worker:0\] WARNING profile: worker0 ran [01] step\(s\) in this command", proc.stderr), proc.stderr[-3000:]


def test_a_window_longer_than_the_run_exits_2_naming_the_key(run_dlaunch):
    proc, _ = run_dlaunch("trainer.steps=8", "trainer.profile.enabled=true")
    assert proc.returncode == 2
    assert "trainer.profile.wait = 10" in proc.stderr  # the default wait alone is what does not fit
    assert "(wait 10 + warmup 2 + active 3 = 15 steps) is longer than trainer.steps=8" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc, _ = run_dlaunch("trainer.steps=8", "trainer.profile.enabled=true", "trainer.profile.wait=0", "trainer.profile.active=9")
    assert proc.returncode == 2 and "trainer.profile.active = 9" in proc.stderr


def test_every_region_the_loop_labels_is_known():
    """The loop and the parameter-server worker label only the regions the op table reports."""
    from pathlib import Path

    import launcher.runtime.loop as loop
    import launcher.runtime.ps_task as ps_task

    used = {m for f in (loop.__file__, ps_task.__file__) for m in re.findall(r'region\("([^"]+)"\)', Path(f).read_text())}
    assert used == set(REGIONS)
