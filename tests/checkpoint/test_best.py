"""trainer.checkpoint.best: the checkpoint of the best evaluation, kept beside the newest (launcher/checkpoint/best.py)."""

from __future__ import annotations

import json

import pytest

from launcher.checkpoint import CheckpointError, layout, read_tensors, weights
from launcher.checkpoint.best import Best
from launcher.config.trainer import BestSpec
from tests.checkpoint.test_layout import fake_manifest
from tests.conftest import summary

# linear's eval_loss falls to step 140 of 200, then rises and falls (seed 0): the best is neither the first nor the last
RUN = ("recipe=linear", "trainer.steps=200", "trainer.eval_every=10", "trainer.checkpoint.every_steps=50",
       "trainer.checkpoint.keep=1", "trainer.checkpoint.best.metric=eval_loss")


def _judged(best: Best, values: list[float]) -> list[bool]:
    return [best.judge(10 * (i + 1), {"loss": v, "accuracy": -v}) for i, v in enumerate(values)]


def test_the_lowest_or_the_highest_is_kept_a_tie_or_nan_is_no_new_best():
    lowest = Best(BestSpec(metric="loss"), rank=0)
    assert _judged(lowest, [3.0, 2.0, 2.0, float("nan"), 2.5, 1.0]) == [True, True, False, False, False, True]
    assert (lowest.value, lowest.step) == (1.0, 60)
    highest = Best(BestSpec(metric="loss", mode="max"), rank=0)  # the mode given wins over the name
    assert _judged(highest, [3.0, 2.0, 4.0]) == [True, False, True] and highest.said() == "loss=4 at step 30"
    assert Best(BestSpec(metric="accuracy"), rank=0).lower is False
    assert BestSpec(metric="eval_bits_per_char").lower is True and BestSpec(metric="f1-macro").lower is False


def test_a_metric_evaluate_does_not_return_is_named_with_those_it_does():
    with pytest.raises(CheckpointError, match=r"best.metric=acc is not among the metrics evaluate returned at step 10 "
                                              r"\(loss, accuracy\); name one of them"):
        _judged(Best(BestSpec(metric="acc"), rank=0), [1.0])


def test_a_resumed_run_judges_against_the_best_its_checkpoint_recorded():
    best = Best(BestSpec(metric="loss"), rank=0)
    best.restore({"best": {"metric": "loss", "mode": "min", "value": 0.5, "step": 40}})
    assert _judged(best, [0.6, 0.4]) == [False, True]
    assert best.record() == {"best": {"metric": "loss", "mode": "min", "value": 0.4, "step": 20}}
    best.restore({"best": {"metric": "accuracy", "mode": "max", "value": 0.9, "step": 40}})  # another metric: afresh
    assert best.value is None and best.record() == {} and _judged(best, [7.0]) == [True]


def _save(root, step, best_step=None, keep=1):
    partial = layout.partial_dir(root, step)
    partial.mkdir(parents=True)
    (partial / ".metadata").write_bytes(b"meta")
    record = {"best": {"metric": "loss", "mode": "min", "value": 0.1, "step": best_step}} if best_step else {}
    return layout.commit(partial, {**fake_manifest(step), **record}, keep)


def test_retention_keeps_the_best_and_the_marker_names_it(tmp_path):
    for step, best in ((10, 10), (20, 20), (30, 20), (40, 20), (50, 50), (60, 50)):
        _save(tmp_path, step, best)
    assert [p.name for p in layout.complete_steps(tmp_path)] == ["step-00000050", "step-00000060"]
    assert (tmp_path / "best").read_text().strip() == "step-00000050"
    assert layout.marked(tmp_path / "best") == layout.step_dir(tmp_path, 50)
    assert layout.resolve(str(tmp_path / "best"), tmp_path).path == layout.step_dir(tmp_path, 50)  # trainer.resume=PATH
    assert weights.source(str(tmp_path / "best")) == layout.step_dir(tmp_path, 50)  # trainer.pretrained.path
    assert layout.marked(tmp_path / "nothing") == tmp_path / "nothing"


def test_a_resume_from_an_earlier_step_names_that_steps_best(tmp_path):
    for step, best in ((10, 10), (20, 10), (30, 30), (40, 30)):
        _save(tmp_path, step, best, keep=4)
    layout.set_aside_after(tmp_path, 20)  # another timeline from step 20: its best was step 10's
    assert (tmp_path / "best").read_text().strip() == "step-00000010"
    layout.set_aside_after(tmp_path, 0)  # afresh: no best yet
    assert not (tmp_path / "best").exists()


def _best_of(run_dir):
    root = run_dir / "checkpoints"
    records = [json.loads((p / "manifest.json").read_text()).get("best") for p in layout.complete_steps(root)]
    best = summary(run_dir)["best"]
    assert best["checkpoint"] == str(root / (root / "best").read_text().strip())
    return ({k: v for k, v in best.items() if k != "checkpoint"}, (root / "best").read_text().strip(),
            [p.name for p in layout.complete_steps(root)], records)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [("strategy=one_device",), ("strategy=mirrored", "cluster=1x2")], ids=["one", "1x2"])
def test_a_run_stopped_and_resumed_keeps_the_best_of_one_that_never_stopped(run_dlaunch, shape):
    straight, straight_dir = run_dlaunch(*RUN, *shape, name="straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first, run_dir = run_dlaunch(*RUN, *shape, "trainer.steps=100", name="resumed")
    assert first.returncode == 0, first.stderr[-3000:]
    again, _ = run_dlaunch(*RUN, *shape, name="resumed")
    assert again.returncode == 0, again.stderr[-3000:]
    found = _best_of(straight_dir)
    assert found == _best_of(run_dir)
    best, marker, kept, records = found
    assert 50 < best["step"] < 200 and marker == f"step-{best['step']:08d}" and kept == [marker, "step-00000200"]
    assert records[-1]["step"] == best["step"] and records[-1]["value"] == best["value"]
    evaluated = [r for line in (straight_dir / "metrics.jsonl").read_text().splitlines()
                 if "eval_loss" in (r := json.loads(line))]
    assert [r["step"] for r in evaluated] == list(range(10, 201, 10))  # the end's too, once
    assert best["value"] == min(r["eval_loss"] for r in evaluated)
    model = read_tensors(straight_dir / "checkpoints" / "best")  # the marker reads as the step it names
    assert model.keys() == read_tensors(straight_dir / "checkpoints" / marker).keys()
    assert f"best                  eval_loss={best['value']:.6g} at step {best['step']}" in straight.stdout


@pytest.mark.slow
def test_a_metric_evaluate_does_not_return_ends_every_rank_with_the_names(run_dlaunch):
    proc, run_dir = run_dlaunch(*RUN, "strategy=mirrored", "cluster=1x2", "trainer.checkpoint.best.metric=accuracy",
                                "trainer.checkpoint.best.mode=max", timeout=120)
    assert proc.returncode == 1
    said = proc.stdout + proc.stderr
    assert said.count("trainer.checkpoint.best.metric=accuracy is not among the metrics evaluate returned at step 10 "
                      "(eval_loss)") == 1, said[-3000:]
    assert "rank 1: exit code 1: the same CheckpointError as rank 0" in said


def test_best_without_evaluations_or_checkpoints_or_a_direction_is_one_screen(run_dlaunch):
    proc, _ = run_dlaunch("trainer.checkpoint.best.metric=wellness")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    for key, why in (("trainer.checkpoint.every_steps = 0", "turn checkpoints on (every_steps=N)"),
                     ("trainer.eval_every = 0", "set trainer.eval_every=N"),
                     ("trainer.checkpoint.best.mode = auto", "the name 'wellness' does not say whether lower or higher "
                                                             "is better; allowed: min, max")):
        assert key in proc.stderr and why in proc.stderr, proc.stderr
    plan, _ = run_dlaunch(*RUN, "launch.dry_run=true", name="plan")
    assert plan.returncode == 0 and "keep 1, and the one with the lowest eval_loss)" in plan.stdout


def test_a_script_is_told_to_keep_its_own_best(run_dlaunch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    proc, _ = run_dlaunch(f"script={script}", "trainer.checkpoint.best.metric=eval_loss")
    assert proc.returncode == 2 and "trainer.checkpoint.best.metric = eval_loss" in proc.stderr
    assert "a script saves its own checkpoints" in proc.stderr and "trainer.eval_every = 0" not in proc.stderr


def test_a_new_best_whose_save_the_disk_refused_leaves_the_best_saved_one():
    best = Best(BestSpec(metric="loss"), rank=0)
    assert _judged(best, [2.0, 1.0]) == [True, True]
    best.unsaved(20)  # trainer.checkpoint.on_error=warn: step 20 was not saved
    assert (best.value, best.step) == (2.0, 10) and _judged(best, [1.5]) == [True]


def test_the_marker_goes_with_its_checkpoint_once_no_best_is_judged(tmp_path):
    _save(tmp_path, 10, best_step=10)
    _save(tmp_path, 20)  # resumed with trainer.checkpoint.best.metric=null: step 10 is pruned as any other
    assert [p.name for p in layout.complete_steps(tmp_path)] == ["step-00000020"] and not (tmp_path / "best").exists()
