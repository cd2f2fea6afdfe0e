"""A script's own checkpoints (launcher/checkpoint/scripts.py), in real gloo processes through dlaunch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from launcher.checkpoint import layout, read_tensors
from launcher.checkpoint.scripts import ScriptCheckpoints
from tests.conftest import FIXTURES, dlaunch

SCRIPT = FIXTURES / "checkpointed_loop.py"


def run(tmp_path, run_dir, *args: str, resume: bool = False):
    shape = () if resume else ("strategy=mirrored", "cluster=1x2", f"hydra.run.dir={run_dir}")
    head = ("resume", str(run_dir)) if resume else (f"script={tmp_path / 'loop.py'}",)
    proc = dlaunch(*head, *shape, "--", *args, cwd=tmp_path, device=None if resume else "cpu")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_script_stopped_after_a_save_resumes_bit_for_bit(tmp_path):
    """7 steps straight, against 4 steps then `dlaunch resume RUN_DIR -- 7`: the same step-6 checkpoint, bit for bit
    (model, AdamW's state, the RNG that draws the noise), the script's own tensor and its LR schedule restored, and
    the same losses and lrs printed for steps 5-7."""
    shutil.copy(SCRIPT, tmp_path / "loop.py")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    out = run(tmp_path, straight, "7")
    assert "starting after step 0, 0 draws seen" in out
    run(tmp_path, stopped, "4")
    resumed = run(tmp_path, stopped, "7", resume=True)
    assert "starting after step 4, 4 draws seen" in resumed and "step 4: loss" not in resumed
    later = [line for line in out.splitlines() if line.startswith(("step 5:", "step 6:", "step 7:"))]
    assert len(later) == 3 and "lr 0.0025" in later[-1]  # halved after steps 3 and 6
    assert later == [line for line in resumed.splitlines() if line.startswith(("step 5:", "step 6:", "step 7:"))]
    history = json.loads((stopped / "summary.json").read_text())["history"]
    assert (history["commands"], history["resumes"]) == (2, 1)  # ScriptCheckpoints.restore counted its resume
    # keep=2: steps 4 and 6 are kept, 2 pruned; every file listed with its digest
    assert [p.name for p in layout.complete_steps(stopped / "checkpoints")] == ["step-00000004", "step-00000006"]
    for directory in (straight, stopped):
        assert layout.check(layout.step_dir(directory / "checkpoints", 6)) is None
    for prefix in ("model", "optim"):
        a = read_tensors(layout.step_dir(straight / "checkpoints", 6), prefix)
        b = read_tensors(layout.step_dir(stopped / "checkpoints", 6), prefix)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), prefix


@pytest.mark.slow
def test_a_scripts_one_process_save_resumes_on_two_ranks_with_rank_0s_objects(tmp_path):
    """DCP reshards the model; the schedule, saved by the one rank there was, goes to both, and a warning says so."""
    shutil.copy(SCRIPT, tmp_path / "loop.py")
    run_dir = tmp_path / "run"
    proc = dlaunch(f"script={tmp_path / 'loop.py'}", f"hydra.run.dir={run_dir}", "--", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = dlaunch("resume", str(run_dir), "strategy=mirrored", "cluster=1x2", "--", "6", cwd=tmp_path, device=None)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "starting after step 4, 4 draws seen" in out, out[-3000:]
    assert ("objects schedule: restored from rank 0's saved state on rank 1, which the saving run (1 rank(s)) did "
            "not have") in " ".join(out.split())


@pytest.mark.slow
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


def _trained(lr: float = 0.1):
    """A model, its optimizer and a warm-up-then-cosine schedule, at step 0."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, total_iters=3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10)
    return model, optimizer, torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cosine], milestones=[3])


def test_objects_come_back_as_they_were_saved_in_one_process(tmp_path):
    """A schedule inside a schedule, a GradScaler with a grown scale, and a disabled one (no state) in plain python."""
    model, optimizer, schedule = _trained()
    scaler, off = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1), torch.amp.GradScaler("cpu", enabled=False)
    for _ in range(5):
        optimizer.step()
        schedule.step()
    scaler.scale(torch.ones(()))
    scaler.update(16.0)  # a scale of its own, not the 8.0 it began with
    ckpt = ScriptCheckpoints(tmp_path)
    ckpt.save(5, model, optimizer, objects={"schedule": schedule, "scaler": scaler, "off": off})
    model2, optimizer2, schedule2 = _trained(lr=0.5)
    scaler2 = torch.amp.GradScaler("cpu")
    assert ckpt.restore(model2, optimizer2, objects={"schedule": schedule2, "scaler": scaler2, "off": off}) == 5
    assert schedule2.state_dict() == schedule.state_dict() and scaler2.state_dict() == scaler.state_dict()
    optimizer2.step()
    schedule2.step()
    optimizer.step()
    schedule.step()
    assert schedule2.get_last_lr() == schedule.get_last_lr()


def test_an_objects_state_comes_back_whole_where_a_fresh_one_has_less(tmp_path):
    """A second optimizer (a GAN's discriminator): a fresh one's state_dict() has no moments yet; the saved ones load."""
    model, optimizer, _ = _trained()
    critic = torch.nn.Linear(3, 1)
    critic_optimizer = torch.optim.Adam(critic.parameters(), lr=0.01)
    critic(torch.ones(2, 3)).sum().backward()
    critic_optimizer.step()
    ScriptCheckpoints(tmp_path).save(1, model, optimizer, objects={"critic": critic_optimizer})
    fresh = torch.optim.Adam(critic.parameters(), lr=0.5)
    assert fresh.state_dict()["state"] == {}
    ScriptCheckpoints(tmp_path).restore(model, optimizer, objects={"critic": fresh})
    saved, restored = critic_optimizer.state_dict(), fresh.state_dict()
    assert restored["param_groups"][0]["lr"] == 0.01 and restored["state"].keys() == saved["state"].keys()
    assert all(torch.equal(restored["state"][0][k], saved["state"][0][k]) for k in ("exp_avg", "exp_avg_sq"))


def test_an_object_the_save_lacks_keeps_its_own_state_and_is_named(tmp_path, caplog):
    """A run that adopts objects resumes from a checkpoint saved without them: those start as built, said once."""
    model, optimizer, schedule = _trained()
    ckpt = ScriptCheckpoints(tmp_path)
    ckpt.save(1, model, optimizer, objects={"schedule": schedule})
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    assert ckpt.restore(model, optimizer, objects={"scaler": scaler, "schedule": schedule}) == 1
    assert scaler.get_scale() == 4.0
    assert "has no saved state for objects scaler (it has: schedule): they keep the state they were built with" in caplog.text


class _NumpyRandom:
    """A sampler whose state is numpy's RNG tuple: a restore could not load it without unpickling code."""

    def state_dict(self):
        import numpy as np

        return {"rng": np.random.get_state()}

    def load_state_dict(self, state):
        raise AssertionError("never restored")


@pytest.mark.parametrize("objects, error", [({"a.b": torch.amp.GradScaler("cpu")}, "without dots"),
                                            ({"model": torch.zeros(1)}, "a Tensor has no state_dict"),
                                            ({"sampler": _NumpyRandom()}, "holds more than tensors and plain data")])
def test_objects_that_cannot_be_saved_are_refused_before_writing(tmp_path, objects, error):
    model, optimizer, _ = _trained()
    with pytest.raises((ValueError, TypeError), match=error):
        ScriptCheckpoints(tmp_path).save(1, model, optimizer, objects=objects)
    assert not list(tmp_path.iterdir())


def test_a_stop_signal_during_a_restore_stays_a_stop_not_a_checkpoint_error(tmp_path, monkeypatch):
    """DCP wraps whatever a rank raised while it loaded; Ctrl-C there is a KeyboardInterrupt (exit 130), not a
    damaged checkpoint (exit 1), and reaches a script's own `except KeyboardInterrupt:`."""
    import signal

    from launcher.checkpoint.safe import SafeLoadPlanner
    from launcher.runtime.script import ScriptInterrupted

    model, optimizer, schedule = _trained()
    ckpt = ScriptCheckpoints(tmp_path)
    ckpt.save(1, model, optimizer, objects={"schedule": schedule})

    def interrupted(self, read_item, value):
        raise ScriptInterrupted(signal.SIGINT)

    monkeypatch.setattr(SafeLoadPlanner, "load_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.restore(model, optimizer, objects={"schedule": schedule})


FAILS = """import json, os, sys
from pathlib import Path

import torch

from launcher import distribute as dl
from launcher.checkpoint.scripts import ScriptCheckpoints

steps, fail_at = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0
strategy = dl.get_strategy()
with strategy.scope():
    model = strategy.prepare(torch.nn.Linear(2, 1))
ckpt = ScriptCheckpoints()
start = ckpt.restore(model)
print(f"starting after step {start}", flush=True)
for step in range(start + 1, steps + 1):
    if step == fail_at:
        raise ValueError(f"my bug at step {step}")
    if strategy.extended.should_save_summary:
        with open(Path(os.environ["DLAUNCH_RUN_DIR"]) / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\\n")
    if step % 2 == 0:
        ckpt.save(step, model)
"""


def test_a_failed_script_run_names_its_newest_checkpoint_and_the_resume_that_goes_on_from_it(tmp_path):
    """As a failed recipe run: the newest save and `dlaunch resume RUN_DIR`, which runs the script again from it.
    Its summary.json says what its panel says (the last logged step), and names the script, not a recipe."""
    (tmp_path / "fails.py").write_text(FAILS)
    run_dir = tmp_path / "run"
    proc = dlaunch("script=fails.py", "strategy=mirrored", "cluster=1x2", f"hydra.run.dir={run_dir}", "--", "6", "5",
                   cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert f"newest checkpoint: {layout.step_dir(run_dir / 'checkpoints', 4)}" in out
    assert f"go on from it with: dlaunch resume {run_dir}" in out and "last logged step 4" in out
    failed = json.loads((run_dir / "summary.json").read_text())
    assert (failed["status"], failed["script"], failed["recipe"], failed["last_logged_step"]) == ("failed", "fails.py 6 5", None, 4)
    assert "last_completed_step" not in failed  # dlaunch runs no steps of a script's: its own records say
    proc = dlaunch("resume", str(run_dir), "--", "6", cwd=tmp_path)
    assert proc.returncode == 0 and "starting after step 4" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    done = json.loads((run_dir / "summary.json").read_text())
    assert (done["status"], done["recipe"], done["last_logged_step"]) == ("completed", None, 6)
