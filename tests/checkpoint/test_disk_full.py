"""A disk that fills up during a save: the previous checkpoint stays, ``latest`` names it, nothing half-written is resumed.

The fault is real from DCP's writer on: ``DLAUNCH_TEST_DISK_FULL_AT_STEP`` makes the
writer's files fail with ENOSPC halfway through their first write (``launcher/checkpoint/writer.py``).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from launcher.checkpoint import Checkpointer, CheckpointError, layout
from launcher.config.compose import compose_and_validate
from launcher.input.position import Position
from tests.conftest import summary

DISK_FULL = "DLAUNCH_TEST_DISK_FULL_AT_STEP"


def saver(tmp_path, *overrides):
    spec = compose_and_validate(["trainer.checkpoint.every_steps=5", "trainer.steps=20", *overrides], cuda_devices=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ckpt = Checkpointer(spec, tmp_path, rank=0)
    return lambda step: ckpt.save(step, Position(0, step), model, torch.optim.SGD(model.parameters(), lr=0.1))


def assert_untouched(root, step):
    assert (root / "latest").read_text().strip() == f"step-{step:08d}"
    assert layout.choose(root) == layout.Choice(layout.step_dir(root, step))  # intact, nothing skipped
    assert not list(root.glob(".step-*.partial")), "the half-written save was removed"


def test_a_full_disk_ends_the_run_with_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    save = saver(tmp_path)
    save(5)
    monkeypatch.setenv(DISK_FULL, "10")
    with pytest.raises(CheckpointError) as caught:
        save(10)
    text = str(caught.value)
    assert "step 10 was not saved" in text and "No space left on device" in text and "__0_0.distcp" in text
    assert "step-00000005 is intact" in text and "trainer.checkpoint.on_error=warn" in text
    assert_untouched(tmp_path / "checkpoints", 5)


def test_with_on_error_warn_training_goes_on_and_the_next_save_lands(tmp_path, monkeypatch, caplog):
    save = saver(tmp_path, "trainer.checkpoint.on_error=warn")
    save(5)
    monkeypatch.setenv(DISK_FULL, "10")
    with caplog.at_level(logging.WARNING, logger="dlaunch"):
        assert save(10) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "step 10 was not saved" in warning and "training continues" in warning
    assert_untouched(tmp_path / "checkpoints", 5)
    assert save(15) == layout.step_dir(tmp_path / "checkpoints", 15)
    assert_untouched(tmp_path / "checkpoints", 15)


def test_with_on_error_warn_a_failed_save_on_a_stop_is_said_to_be_lost_not_that_training_continues(tmp_path, monkeypatch, caplog):
    """The stop said "no checkpoint (trainer.checkpoint.every_steps is 0)" with every_steps=5, and its summary named
    the earlier checkpoint as if it were the stop's."""
    from launcher.cli import resume_lines
    from launcher.launch import report
    from launcher.runtime.preemption import Preempted

    spec = compose_and_validate(["trainer.checkpoint.every_steps=5", "trainer.steps=20", "trainer.checkpoint.on_error=warn"],
                                cuda_devices=0)
    model = torch.nn.Linear(4, 1)
    ckpt = Checkpointer(spec, tmp_path, rank=0)
    ckpt.save(5, Position(0, 5), model, torch.optim.SGD(model.parameters(), lr=0.1))
    monkeypatch.setenv(DISK_FULL, "7")
    with caplog.at_level(logging.WARNING, logger="dlaunch"):
        assert ckpt.save(7, Position(0, 7), model, torch.optim.SGD(model.parameters(), lr=0.1), stopping=True) is None
    assert "training continues" not in caplog.text
    stopped = str(Preempted(15, 7, None, unsaved=ckpt.unsaved))
    assert "every_steps is 0" not in stopped and "step 7 was not saved: No space left on device" in stopped
    assert "step-00000005 is intact" in stopped
    checkpoint = layout.latest(tmp_path / "checkpoints")
    told = resume_lines.after_signal(spec, tmp_path, 143, checkpoint)
    assert "step 7 was not saved: No space left on device" in told and "from step 5" in told
    report.record_stop(spec, tmp_path, 143, checkpoint)
    saved = summary(tmp_path)
    assert saved["checkpoint_step"] == 5 and saved["unsaved_checkpoint"]["step"] == 7


def test_with_on_error_error_a_failed_save_on_a_stop_fails_the_run_and_says_the_stops_checkpoint_is_lost(tmp_path, monkeypatch):
    """The user asked for a refused save to be an error, a stop's too (exit 1); the message told them to "train on
    without this save", which means nothing to a run that was stopped."""
    spec = compose_and_validate(["trainer.checkpoint.every_steps=5", "trainer.steps=20"], cuda_devices=0)
    model = torch.nn.Linear(4, 1)
    ckpt = Checkpointer(spec, tmp_path, rank=0)
    ckpt.save(5, Position(0, 5), model, torch.optim.SGD(model.parameters(), lr=0.1))
    monkeypatch.setenv(DISK_FULL, "7")
    with pytest.raises(CheckpointError) as caught:
        ckpt.save(7, Position(0, 7), model, torch.optim.SGD(model.parameters(), lr=0.1), stopping=True)
    text = str(caught.value)
    assert "step 7 was not saved: No space left on device" in text and "train on without this save" not in text
    assert "the checkpoint of a stop signal: the run stopped without it" in text and "on_error=error" in text
    assert "trainer.resume=auto continues from step-00000005" in text
    assert_untouched(tmp_path / "checkpoints", 5)


def test_a_commit_that_fails_on_rank_0_alone_is_not_saved_again_by_rank_0_alone_at_a_stop(tmp_path, monkeypatch):
    """Every rank's files were written, then rank 0's manifest write failed (on_error=warn): the other ranks held the
    step saved, rank 0 did not, and a stop signal agreed after that step sent rank 0 alone into DCP's collective
    save again, while the others went on to leave: a collective of one, which hangs."""
    spec = compose_and_validate(["trainer.checkpoint.every_steps=5", "trainer.steps=20", "trainer.checkpoint.on_error=warn"],
                                cuda_devices=0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(spec, tmp_path, rank=0)
    ckpt.save(5, Position(0, 5), model, optimizer)
    writes = []
    real_save_here = ckpt._save_here
    monkeypatch.setattr(ckpt, "_save_here", lambda *a: writes.append(a[1]) or real_save_here(*a))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device", "manifest.json")
    monkeypatch.setattr(layout, "commit", full_disk)
    assert ckpt.save(10, Position(0, 10), model, optimizer) is None
    assert ckpt.save(10, Position(0, 10), model, optimizer, stopping=True) is None  # the stop after step 10
    assert writes == [10], "rank 0 ran DCP's collective save again, alone"
    assert "step 10 was not saved: No space left on device" in ckpt.unsaved
    from launcher.runtime import outputs
    assert outputs.unsaved_stop(tmp_path, 5)["step"] == 10  # the stop's summary names the lost save
    assert layout.latest(tmp_path / "checkpoints") == layout.step_dir(tmp_path / "checkpoints", 5)


def test_on_error_allows_only_error_or_warn(tmp_path):
    from launcher.config.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        compose_and_validate(["trainer.checkpoint.on_error=ignore"], cuda_devices=0)
    (problem,) = caught.value.problems
    assert (problem.key, problem.value, problem.allowed) == ("trainer.checkpoint.on_error", "ignore", ("error", "warn"))


COMMON = ("recipe=linear", "strategy=mirrored", "cluster=1x2", "trainer.steps=20", "trainer.log_every=5",
          "trainer.checkpoint.every_steps=5")


@pytest.mark.slow
def test_a_full_disk_in_a_multi_process_run_then_resume_auto(run_dlaunch):
    proc, run_dir = run_dlaunch(*COMMON, env={DISK_FULL: "10", "COLUMNS": "1000"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "step 10 was not saved" in proc.stdout + proc.stderr and "No space left on device" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert_untouched(run_dir / "checkpoints", 5)

    proc, run_dir = run_dlaunch(*COMMON)  # the same command, the disk has room again
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 5
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps == [1, 5, 10, 15, 20]


@pytest.mark.slow
def test_a_full_disk_with_on_error_warn_completes_the_run(run_dlaunch):
    proc, run_dir = run_dlaunch(*COMMON, "trainer.checkpoint.on_error=warn", env={DISK_FULL: "10", "COLUMNS": "1000"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum("step 10 was not saved" in line for line in proc.stderr.splitlines()) == 1
    assert summary(run_dir)["status"] == "completed"
    assert_untouched(run_dir / "checkpoints", 20)
    assert not layout.step_dir(run_dir / "checkpoints", 10).exists()


@pytest.mark.slow
def test_a_stop_whose_save_fails_says_so_and_resume_goes_on_from_the_last_good_step(tmp_path, monkeypatch):
    """Step 14's save lands; SIGTERM comes a few steps later (every save from step 15 on fails: ENOSPC), and the
    stop's own save is refused."""
    import re
    import signal

    from tests.launch.test_restarts import STARTUP_S, finish, logged_steps, start, wait_for

    run_dir = tmp_path / "run"
    monkeypatch.setenv(DISK_FULL, "15+")
    proc = start(run_dir, "trainer.steps=1000", "trainer.checkpoint.every_steps=14", "trainer.checkpoint.on_error=warn",
                 "+recipe.step_sleep=0.3")  # the next scheduled save, step 28's, is 4 s away
    try:
        wait_for(lambda: max(logged_steps(run_dir), default=0) >= 15, STARTUP_S, "step 15")
        proc.send_signal(signal.SIGTERM)
    finally:
        out = finish(proc, timeout=60)
    assert proc.returncode == 143, out[-3000:]
    text = " ".join(out.split())
    assert "every_steps is 0" not in text and "training continues" not in text, out[-3000:]
    stop = int(re.search(r"stopped by SIGTERM after step (\d+); the checkpoint of step \1 was not saved: No space left "
                         r"on device", text).group(1))
    assert 15 <= stop < 28, out[-3000:]
    assert "step-00000014 is intact" in text and f"from step 14: the steps after it up to {stop} are trained again" in text
    assert (summary(run_dir)["checkpoint_step"], summary(run_dir)["unsaved_checkpoint"]["step"]) == (14, stop)


def test_a_real_full_disk_is_found_behind_torchs_zip_writer_and_any_ranks_failure(tmp_path, monkeypatch):
    """On a tmpfs that filled during a save, rank 0's failure was torch's zip writer (`unexpected pos 704 vs 598`, no
    errno) and rank 1's the OSError: the save was not taken for a refused one (a CheckpointException panel, the
    `.partial` left behind, trainer.checkpoint.on_error=warn ignored)."""
    import errno as errnos
    import shutil

    from launcher.checkpoint import errors

    zip_writer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    full = OSError(errnos.ENOSPC, "No space left on device", "__1_0.distcp")

    class Reported(BaseException):  # as DCP's CheckpointException holds each rank's failure
        def __init__(self, *failures):
            self.failures = {rank: (failure, None) for rank, failure in enumerate(failures)}

    assert errors.storage_refusal(Reported(zip_writer, full), tmp_path) is full
    lost = ConnectionResetError(errnos.ECONNRESET, "Connection reset by peer")
    assert errors.storage_refusal(Reported(lost), tmp_path) is None  # a peer's connection is not the storage
    usage = shutil.disk_usage(tmp_path)
    assert errors.storage_refusal(Reported(zip_writer), tmp_path) is None  # room on the disk: another failure
    monkeypatch.setattr(shutil, "disk_usage", lambda where: usage._replace(free=4096))
    refused = errors.storage_refusal(Reported(zip_writer), tmp_path / "not" / "made")
    assert refused is not None and refused.errno == errnos.ENOSPC  # the writer's failure alone, on a full disk
