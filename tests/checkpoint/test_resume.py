"""Exact resume: a run stopped and resumed ends bitwise equal to one that never stopped.

Each strategy trains 30 steps straight through; a second run resumes from that run's
step-15 checkpoint (mid-epoch: 10 batches per epoch, saved while the input pipeline had
read ahead) and trains to 30. Mirrored 1x2 resumes a run that stopped at step 17 instead
(its final checkpoint, `trainer.resume=auto` in the same run directory). Parameters,
optimizer state and the loss curve after the resume point must be identical.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from launcher.checkpoint import layout, read_tensors
from tests.conftest import PROBE, dlaunch, summary

pytestmark = pytest.mark.slow
COMMON = ("recipe=linear", "recipe.examples=640", "trainer.log_every=1", "trainer.checkpoint.every_steps=5",
          "trainer.checkpoint.keep=10")
STRATEGIES = {
    "one_device": ("strategy=one_device",),
    "mirrored": ("strategy=mirrored", "cluster=1x2"),
    "multi_worker_mirrored": ("strategy=multi_worker_mirrored", "cluster=1x2"),
    "central_storage": ("strategy=central_storage", "strategy.compute_devices=[cpu:0,cpu:1]"),
    # each step draws noise from the global torch RNG (as dropout does): its state must travel in the checkpoint
    "mirrored-random-steps": ("strategy=mirrored", "cluster=1x2", f"recipe.entry={PROBE}", "+recipe.input_noise=0.3"),
    # the recipe's own DataLoader: the resume's seek must not draw from the global RNG that the steps go on with
    "own-loader-random-steps": (f"recipe.entry={PROBE}", "+recipe.input_noise=0.3", "+recipe.own_loader=true"),
    # an augmentation in the dataset's __getitem__ draws from the global RNG, one step ahead (the prefetch)
    "item-noise": (f"recipe.entry={PROBE}", "+recipe.item_noise=0.3"),
    # DTensor parameters split over 2 logical devices, 2 replicas
    "mesh-tp_mlp": ("recipe=tp_mlp", "strategy=mesh", "cluster=1x4"),
    # batch-norm statistics: each rank updates its own from its share (DDP hands rank 0's to every rank at each
    # forward, FSDP never); the checkpoint holds rank 0's, the ones its evaluation used
    "mirrored-batch-norm": ("strategy=mirrored", "cluster=1x2", f"recipe.entry={PROBE}", "+recipe.batch_norm=true"),
    "fsdp-batch-norm": ("strategy=fsdp", "cluster=1x2", f"recipe.entry={PROBE}", "+recipe.batch_norm=true"),
}


def losses(run_dir) -> dict[int, float]:
    records = [r for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "loss" in (r := json.loads(line))]
    steps = [r["step"] for r in records]  # the training records (an evaluation's are records of their own)
    assert steps == sorted(set(steps)), f"a step is missing or repeated: {steps}"
    return {r["step"]: r["loss"] for r in records}


def final_state(run_dir) -> tuple[dict, dict]:
    final = layout.latest(run_dir / "checkpoints")
    return read_tensors(final, "model"), read_tensors(final, "optim")


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def run_ok(run_dlaunch, name, *args):
    common = [a for a in COMMON if not (a.startswith("recipe=") and any(b.startswith("recipe=") for b in args))]
    proc, run_dir = run_dlaunch(*common, *args, name=name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, run_dir


_mirrored: dict[str, Path] = {}


def mirrored_1x2(tmp_path_factory, tmp_path):
    """Mirrored 1x2 straight through 30 steps, and a copy (in ``tmp_path``) of a run stopped after 17: both runs are
    made once per test process and shared by the tests that resume at 1x2, 1x1 and 2x2."""
    if not _mirrored:
        root = tmp_path_factory.mktemp("mirrored-1x2")
        for name, steps in (("straight", 30), ("stopped", 17)):
            proc = dlaunch(*COMMON, "strategy=mirrored", "cluster=1x2", f"trainer.steps={steps}", f"hydra.run.dir={root / name}", cwd=root)
            assert proc.returncode == 0, proc.stderr[-3000:]
        _mirrored.update(straight=root / "straight", stopped=root / "stopped")
    shutil.copytree(_mirrored["stopped"], tmp_path / "stopped")
    return _mirrored["straight"], "stopped"


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_resumed_run_is_bitwise_equal_to_an_uninterrupted_one(run_dlaunch, tmp_path_factory, tmp_path, strategy):
    args = STRATEGIES[strategy]
    if strategy == "mirrored":  # a run that stopped at step 17, resumed in its own directory
        straight, stopped = mirrored_1x2(tmp_path_factory, tmp_path)
        proc, resumed = run_ok(run_dlaunch, stopped, *args, "trainer.steps=30")
        at, position, steps = 17, "epoch 1, batch 7", range(1, 31)
    else:  # another run, from the straight run's step-15 checkpoint
        _, straight = run_ok(run_dlaunch, "straight", *args, "trainer.steps=30")
        middle = straight / "checkpoints" / "step-00000015"
        proc, resumed = run_ok(run_dlaunch, "resumed", *args, "trainer.steps=30", f"trainer.resume={middle}")
        at, position, steps = 15, "epoch 1, batch 5", range(16, 31)
    said = proc.stdout + proc.stderr
    assert "resume" in said and f"from step {at}" in said and position in said

    model_a, optim_a = final_state(straight)
    model_b, optim_b = final_state(resumed)
    assert_bitwise_equal(model_a, model_b)
    assert_bitwise_equal(optim_a, optim_b)
    curve_a, curve_b = losses(straight), losses(resumed)
    assert list(curve_b) == list(steps), "no step lost or doubled"
    assert curve_b == {step: curve_a[step] for step in steps}
    s = summary(resumed)
    assert s["resumed_from_step"] == at and s["first_loss"] == curve_a[steps[0]] and s["final_loss"] == curve_a[30]
    if strategy.endswith("batch-norm"):  # what was saved is what rank 0 evaluated, in both runs
        for run_dir, saved in ((straight, model_a), (resumed, model_b)):
            evaluated = torch.load(run_dir / "buffers.pt", weights_only=True)
            assert_bitwise_equal({k: v for k, v in saved.items() if k in evaluated}, evaluated)


@pytest.mark.parametrize("shape", ["1x1", "2x2"])
def test_resume_at_another_world_size_continues_the_loss(run_dlaunch, tmp_path_factory, tmp_path, shape):
    """Saved at 1x2, resumed at 1x1 or 2x2: DCP reshards, the plan says what changed, the loss follows."""
    straight, stopped = mirrored_1x2(tmp_path_factory, tmp_path)
    proc, resumed = run_ok(run_dlaunch, stopped, "strategy=mirrored", f"cluster={shape}", "trainer.steps=30")
    workers = {"1x1": 1, "2x2": 4}[shape]
    assert f"world size 2 -> {workers}" in proc.stdout + proc.stderr
    assert f"per-replica batch 32 -> {64 // workers}" in proc.stdout + proc.stderr
    assert "data re-partitioned" in proc.stdout + proc.stderr
    expected, got = losses(straight), losses(resumed)
    assert list(got) == list(range(1, 31))
    for step in range(18, 31):
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-7), step
    assert summary(resumed)["world_size"] == (workers if workers > 1 else 1)


def test_a_resume_whose_first_batch_leaves_a_process_no_rows_trains_on(run_dlaunch):
    """65 examples in batches of 64 over 2 processes: step 2's batch of one row is rank 0's alone. Resumed from step
    1, rank 1 has no earlier batch to step on at weight 0 (to join the all-reduce): it steps on that batch's first
    row, which its loader reads as its pad. It failed ("the first global batch leaves this process's replicas no
    rows"), and so would every restart. The resumed run ends bitwise equal to one that never stopped."""
    args = ("recipe=linear", "recipe.examples=65", "input.drop_remainder=false", "trainer.log_every=1",
            "strategy=mirrored", "cluster=1x2", "trainer.checkpoint.every_steps=1")
    straight, straight_dir = run_dlaunch(*args, "trainer.steps=4", name="straight")
    first, run_dir = run_dlaunch(*args, "trainer.steps=1", name="resumed")
    again, _ = run_dlaunch(*args, "trainer.steps=4", name="resumed")
    assert straight.returncode == first.returncode == again.returncode == 0, again.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 1
    assert losses(run_dir) == losses(straight_dir)
    for a, b in zip(final_state(run_dir), final_state(straight_dir)):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("shape", ["one_device", "mirrored"])
def test_a_recipes_plain_shuffling_loader_resumes_exactly_without_reading_the_batches_before(run_dlaunch, shape):
    """A recipe's DataLoader(dataset, batch_size=B, shuffle=True), as users write one: its order came from the global
    RNG at each epoch's start, so a resume replayed every earlier batch and then trained on other batches. dlaunch
    reads it in input.seed's order: the resumed run seeks (reads only the rows it trains on, and one batch ahead)
    and ends bitwise equal to one that never stopped."""
    fixture = Path(__file__).parent.parent / "fixtures" / "plain_loader_recipe.py"
    args = ("recipe=linear", f"recipe.entry={fixture}", "recipe.examples=320", "trainer.log_every=1",
            "trainer.checkpoint.every_steps=12", *STRATEGIES[shape])  # 5 batches an epoch: resumed mid-epoch 3
    straight, straight_dir = run_dlaunch(*args, "trainer.steps=20", name="straight")
    first, run_dir = run_dlaunch(*args, "trainer.steps=12", name="resumed")
    again, _ = run_dlaunch(*args, "trainer.steps=20", name="resumed")
    assert straight.returncode == first.returncode == again.returncode == 0, again.stderr[-3000:]
    assert "cannot seek" not in again.stderr and summary(run_dir)["resumed_from_step"] == 12
    assert losses(run_dir) == losses(straight_dir)
    for a, b in zip(final_state(run_dir), final_state(straight_dir)):
        assert_bitwise_equal(a, b)
    per_rank = 64 // (2 if shape == "mirrored" else 1)  # a rank reads its own rows
    assert int((run_dir / "rows-read-rank0.txt").read_text()) <= (8 + 1) * per_rank  # steps 13-20 and one ahead


def test_a_checkpoint_of_another_recipe_is_refused_before_anything_starts(run_dlaunch, tmp_path):
    _, run_dir = run_ok(run_dlaunch, "run", "trainer.steps=5")
    manifest = json.loads((layout.latest(run_dir / "checkpoints") / "manifest.json").read_text())
    manifest["recipe"]["name"] = "digits"
    (layout.latest(run_dir / "checkpoints") / "manifest.json").write_text(json.dumps(manifest))
    proc, _ = run_dlaunch(*COMMON, "trainer.steps=10", name="run")
    assert proc.returncode == 2
    text = " ".join(proc.stderr.replace("│", " ").split())  # rich wraps long paths
    assert "trainer.resume" in text and "saved by recipe digits" in text
    assert "Traceback" not in text


def test_a_model_that_changed_shape_is_refused_before_anything_starts(run_dlaunch):
    """recipe.features=16 on a checkpoint of 32: every worker started and failed at the load, and the completed
    run's summary.json said failed. The parent builds the model on the meta device and compares shapes: exit 2."""
    run_ok(run_dlaunch, "run", "trainer.steps=5")
    proc, run_dir = run_dlaunch(*COMMON, "trainer.steps=10", "recipe.features=16", name="run")
    assert proc.returncode == 2
    text = " ".join((proc.stdout + proc.stderr).replace("│", " ").split())  # rich wraps and frames
    assert ("step-00000005 does not fit this run's model: model.weight is [1, 32] in the checkpoint and [1, 16] here; "
            "since the checkpoint recipe.features: 32 -> 16. To resume, set them back; to train the new shape from step "
            "0, add trainer.resume=never or use another hydra.run.dir") in text
    assert "Traceback" not in text
    assert summary(run_dir)["status"] == "completed"
