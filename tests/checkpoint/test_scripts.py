"""A script's own checkpoints (launcher/checkpoint/scripts.py), in real gloo processes through dlaunch."""

from __future__ import annotations

import shutil

import pytest
import torch

from launcher.checkpoint import layout, read_tensors
from tests.conftest import FIXTURES, dlaunch

pytestmark = pytest.mark.slow
SCRIPT = FIXTURES / "checkpointed_loop.py"


def run(tmp_path, run_dir, *args: str, resume: bool = False):
    shape = () if resume else ("strategy=mirrored", "cluster=1x2", f"hydra.run.dir={run_dir}")
    head = ("resume", str(run_dir)) if resume else (f"script={tmp_path / 'loop.py'}",)
    proc = dlaunch(*head, *shape, "--", *args, cwd=tmp_path, device=None if resume else "cpu")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_a_script_stopped_after_a_save_resumes_bit_for_bit(tmp_path):
    """7 steps straight, against 4 steps then `dlaunch resume RUN_DIR -- 7`: the same step-6 checkpoint, bit for bit
    (model, AdamW's state, the RNG that draws the noise), and the script's own tensor restored."""
    shutil.copy(SCRIPT, tmp_path / "loop.py")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    out = run(tmp_path, straight, "7")
    assert "starting after step 0, 0 draws seen" in out
    run(tmp_path, stopped, "4")
    out = run(tmp_path, stopped, "7", resume=True)
    assert "starting after step 4, 4 draws seen" in out and "step 5: loss" in out and "step 4: loss" not in out
    # keep=2: steps 4 and 6 are kept, 2 pruned; every file listed with its digest
    assert [p.name for p in layout.complete_steps(stopped / "checkpoints")] == ["step-00000004", "step-00000006"]
    for directory in (straight, stopped):
        assert layout.check(layout.step_dir(directory / "checkpoints", 6)) is None
    for prefix in ("model", "optim"):
        a = read_tensors(layout.step_dir(straight / "checkpoints", 6), prefix)
        b = read_tensors(layout.step_dir(stopped / "checkpoints", 6), prefix)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), prefix


def test_a_damaged_newest_save_is_passed_over_for_the_one_before(tmp_path):
    shutil.copy(SCRIPT, tmp_path / "loop.py")
    run_dir = tmp_path / "run"
    run(tmp_path, run_dir, "4")
    newest = layout.step_dir(run_dir / "checkpoints", 4)
    data = next(newest.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-5])
    out = run(tmp_path, run_dir, "5", resume=True)
    assert "starting after step 2, 2 draws seen" in out
    assert f"checkpoint {newest} is damaged and was skipped" in out


def test_the_docs_show_the_script_that_the_test_runs():
    from tests.conftest import ROOT

    assert SCRIPT.read_text().strip() in (ROOT / "docs" / "SCRIPTS.md").read_text()
