"""``dlaunch`` resumes from the newest intact checkpoint: damage found before anything starts, one warning line each.

A 40-step run saves steps 10..40; each test damages a copy of it and runs the same command to step 50.
"""

from __future__ import annotations

import json
import shutil

import pytest

from launcher.checkpoint import layout
from tests.checkpoint.test_integrity import flip_a_bit, truncate
from tests.conftest import summary

pytestmark = pytest.mark.slow
COMMON = ("recipe=linear", "trainer.log_every=10", "trainer.checkpoint.every_steps=10", "trainer.checkpoint.keep=5")
SKIPPED = "is damaged and was skipped"
WIDE = {"COLUMNS": "1000"}  # a log record on one console line, however long its paths


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """One run's directory with checkpoints at steps 10, 20, 30 and 40 (copied by each test)."""
    from tests.conftest import dlaunch

    base = tmp_path_factory.mktemp("saved")
    proc = dlaunch(*COMMON, "trainer.steps=40", f"hydra.run.dir={base / 'run'}", cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base / "run"


def copy_of(saved_run, tmp_path, name="run"):
    shutil.copytree(saved_run, tmp_path / name)
    return tmp_path / name / "checkpoints"


def delete_step_40_and_name_50(root):
    shutil.rmtree(root / "step-00000040")
    (root / "latest").write_text("step-00000050\n")


DAMAGE = {
    "truncated": (lambda root: truncate(root / "step-00000040"), "step-00000040", "(truncated)"),
    "bit-flipped": (lambda root: flip_a_bit(root / "step-00000040"), "step-00000040", "does not match its sha256"),
    "missing file": (lambda root: next((root / "step-00000040").glob("*.distcp")).unlink(), "step-00000040", ".distcp is missing"),
    "missing manifest": (lambda root: (root / "step-00000040" / "manifest.json").unlink(), "step-00000040", "manifest.json is missing"),
    "latest names a deleted step": (delete_step_40_and_name_50, "step-00000050", "latest names it, but it does not exist"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_with_one_warning(saved_run, run_dlaunch, tmp_path, case):
    damage, name, reason = DAMAGE[case]
    root = copy_of(saved_run, tmp_path)
    damage(root)
    proc, run_dir = run_dlaunch(*COMMON, "trainer.steps=50", env=WIDE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if SKIPPED in line]
    assert len(warnings) == 1 and name in warnings[0], proc.stderr
    assert reason in " ".join((proc.stdout + proc.stderr).split()), proc.stderr
    assert "from step 30" in proc.stdout + proc.stderr
    assert summary(run_dir)["resumed_from_step"] == 30
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps == [1, 10, 20, 30, 40, 50], "the steps after 30 were trained again, once"
    assert layout.choose(root).path == layout.step_dir(root, 50)  # the damaged one was set aside, not reused


def test_a_garbled_latest_is_reported_and_the_newest_intact_step_resumed(saved_run, run_dlaunch, tmp_path):
    root = copy_of(saved_run, tmp_path)
    (root / "latest").write_bytes(b"step-000\x0040\xff")  # flipped bits
    proc, run_dir = run_dlaunch(*COMMON, "trainer.steps=50", env=WIDE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (warning,) = [line for line in proc.stderr.splitlines() if SKIPPED in line]
    assert f"{root / 'latest'} {SKIPPED}: the marker is garbled" in warning and "the step directories decide" in warning
    assert summary(run_dir)["resumed_from_step"] == 40
    assert (root / "latest").read_text() == "step-00000050\n"


def test_the_dry_run_plan_names_the_checkpoint_it_would_use(saved_run, run_dlaunch, tmp_path):
    truncate(copy_of(saved_run, tmp_path) / "step-00000040")
    proc, _ = run_dlaunch(*COMMON, "trainer.steps=50", "launch.dry_run=true", env=WIDE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "resume from step 30" in text and "step-00000030" in text and "sha256 verified" in text
    assert "skipped step-00000040: damaged" in text


def test_when_no_checkpoint_is_intact_nothing_starts_and_each_is_listed(saved_run, run_dlaunch, tmp_path):
    root = copy_of(saved_run, tmp_path)
    for step in (10, 20, 30, 40):
        truncate(layout.step_dir(root, step))
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    proc, run_dir = run_dlaunch(*COMMON, "trainer.steps=50", env=WIDE)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr and "every checkpoint found" in proc.stdout + proc.stderr
    for step in (10, 20, 30, 40):
        assert f"step-000000{step}" in proc.stdout + proc.stderr
    assert "trainer.resume=never" in proc.stdout + proc.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before, "no worker ran"


def test_workers_of_a_multi_process_run_resume_from_the_checkpoint_the_launcher_verified(saved_run, run_dlaunch, tmp_path):
    root = copy_of(saved_run, tmp_path)
    flip_a_bit(root / "step-00000040")  # same size: only the launcher's digest check sees it
    proc, run_dir = run_dlaunch(*COMMON, "strategy=mirrored", "cluster=1x2", "trainer.steps=50", env=WIDE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(SKIPPED in line for line in proc.stderr.splitlines()) == 1
    assert summary(run_dir)["resumed_from_step"] == 30
