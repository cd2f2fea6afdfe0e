"""The plan's rows (launcher/cli/plan.py): what a run will do, said before it starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.cli import plan
from launcher.config.compose import compose_and_validate


def training_row(*overrides: str) -> str:
    return plan._training(compose_and_validate(["cluster.device=cpu", *overrides], 0), "cpu")


def test_the_training_row_names_precision_compile_clipping_schedule_and_evaluation():
    row = training_row("trainer.steps=100", "trainer.precision=bf16-mixed", "trainer.clip_grad_norm=1.0",
                       "trainer.lr_schedule.decay=cosine", "trainer.lr_schedule.warmup_steps=10", "trainer.eval_every=25")
    assert row == ("bf16 autocast on cpu, fp32 weights; clip grad norm 1; lr: 10 warm-up step(s), then cosine decay to 0 x lr; "
                   "evaluate every 25 steps")


def test_the_training_row_names_the_recomputed_modules_and_one_replica_of_central_storage_may_recompute():
    row = training_row("recipe=charlm", "trainer.activation_checkpointing=[TransformerEncoderLayer]")
    assert row == "fp32; recompute TransformerEncoderLayer in backward (activation checkpointing)"
    # central_storage refuses it over replica threads (tests/config/test_bad_configs.py), not on one device
    assert "recompute Linear" in training_row("strategy=central_storage", "trainer.activation_checkpointing=[Linear]")


def test_under_fsdp_bf16_the_training_row_names_fsdps_mixed_precision_policy():
    """FSDP's MixedPrecisionPolicy gathers and computes in bf16, which plain autocast does not: the row says both."""
    policy = "FSDP MixedPrecisionPolicy: parameters gathered and computed in bf16, gradients reduced in fp32"
    assert training_row("strategy=fsdp", "cluster=1x2", "trainer.precision=bf16-mixed") == (
        f"bf16 autocast on cpu, fp32 weights; {policy}")
    assert policy in training_row("strategy=mesh", "recipe=tp_mlp", "strategy.data_parallel=fsdp", "cluster=1x4",
                                  "trainer.precision=bf16-mixed")
    assert training_row("strategy=fsdp", "cluster=1x2") == "fp32"
    assert policy not in training_row("strategy=mirrored", "cluster=1x2", "trainer.precision=bf16-mixed")


def test_the_schedule_names_where_the_warm_up_starts_how_long_the_decay_lasts_and_the_steps_held_after_it():
    """A decay_steps shorter than the rest of the run leaves its last steps at min lr: the row says so."""
    assert training_row("trainer.steps=30", "trainer.lr_schedule.decay=cosine", "trainer.lr_schedule.decay_steps=10",
                        "trainer.lr_schedule.warmup_steps=5", "trainer.lr_schedule.warmup_start=0.1") == (
        "fp32; lr: 5 warm-up step(s) from 0.1 x lr, then cosine decay over 10 steps to 0 x lr, held for the last 15")
    assert training_row("trainer.steps=30", "trainer.lr_schedule.decay=linear", "trainer.lr_schedule.decay_steps=30",
                        "trainer.lr_schedule.min_lr_ratio=0.5") == "fp32; lr: linear decay over 30 steps to 0.5 x lr"
    assert training_row("trainer.lr_schedule.warmup_steps=5") == "fp32; lr: 5 warm-up step(s), then constant"


def test_an_evaluation_interval_past_the_last_step_is_said_not_refused():
    """A short trial (trainer.steps=30) of a recipe that evaluates every 500 steps runs; the plan says what happens."""
    assert training_row("trainer.steps=30", "trainer.eval_every=500").endswith(
        "evaluate every 500 steps (none before the end: trainer.steps=30)")


def test_later_checkpoints_are_said_to_be_set_aside_only_where_the_run_sets_them_aside(tmp_path):
    """A run sets aside later steps of its own checkpoint directory, and only when it saves: a fine-tune from another
    run's step (trainer.resume=PATH) leaves that run's later steps alone, as the plan must say."""
    from launcher.cli.main import main

    base = tmp_path / "base"
    assert main(["cluster.device=cpu", "trainer.steps=8", "trainer.checkpoint.every_steps=4", f"hydra.run.dir={base}"]) == 0
    step4 = base / "checkpoints" / "step-00000004"

    def rows(run_dir, *overrides):
        spec = compose_and_validate(["cluster.device=cpu", "trainer.steps=12", f"trainer.resume={step4}", *overrides], 0)
        return dict(plan._resume_rows(spec, run_dir, step4))

    assert rows(base, "trainer.checkpoint.every_steps=4")["  later"] == (
        "step-00000008: another timeline from here on; set aside when the run starts")
    assert rows(base)["  later"] == "step-00000008: another timeline from here on; left as they are (checkpoints are off)"
    assert "  later" not in rows(tmp_path / "finetune", "trainer.checkpoint.every_steps=4")


def test_the_batch_row_says_a_last_partial_batch_is_kept_and_weighted():
    spec = compose_and_validate(["cluster.device=cpu", "strategy=mirrored", "cluster=1x2", "input.drop_remainder=false"], 0)
    assert plan._batch(spec, 2, "replica(s)") == (
        "global 64 = 2 replica(s) x 32 per replica; an epoch's last partial batch is kept (input.drop_remainder=false), "
        "each replica's share weighted by its rows")
    spec = compose_and_validate(["cluster.device=cpu", "strategy=mirrored", "cluster=1x2"], 0)
    assert plan._batch(spec, 2, "replica(s)") == "global 64 = 2 replica(s) x 32 per replica"


def test_file_sharding_says_a_longer_workers_partial_last_batch_is_dropped_despite_drop_remainder_false(tmp_path):
    """The shortest worker decides each epoch's steps: input.drop_remainder=false keeps its partial last batch, and a
    longer worker's rows past that step go, its own partial last batch with them. The plan said nothing of it, and
    counted the steps as if the partial batches were dropped (85, where the run takes 86)."""
    from rich.console import Console

    from launcher.recipes import linear

    linear.write_files(tmp_path / "data", shards=3)  # 2730, 2731, 2731 rows: rank 0 reads two files, rank 1 one

    def shown(*overrides: str) -> tuple[str, str]:
        spec = compose_and_validate(["cluster.device=cpu", "strategy=mirrored", "cluster=1x2", "input.auto_shard_policy=file",
                                     f"input.files={tmp_path}/data/train-*.jsonl", *overrides], 0)
        console = Console(record=True, width=400)
        console.print(plan.shard_table(spec))
        return plan._batch(spec, 2, "replica(s)"), " ".join(console.export_text().split())

    batch, shards = shown("input.drop_remainder=false")
    assert batch.endswith("; under FILE sharding each epoch ends with the shortest worker, so a worker with more batches "
                          "drops its rows past that step, its partial last batch included")
    assert ("uneven shards: each epoch ends with the shortest worker, after 86 steps; 2709 of 8192 elements are left out "
            "of each epoch; input.drop_remainder=false keeps the shortest worker's partial last batch, not a longer "
            "worker's") in shards
    batch, shards = shown()
    assert "FILE" not in batch and "after 85 steps; 2752 of 8192 elements" in shards and "drop_remainder" not in shards


def test_one_device_on_a_named_gpu_says_that_gpu():
    """strategy.device=cuda:1 trained there while the plan's devices row said cuda:0."""
    from launcher.config.plan import Plan

    spec = compose_and_validate(["cluster.device=cuda", "strategy=one_device", "strategy.device=GPU:1"], 2)
    rows = dict(plan.plan_rows(spec, Plan.resolve(spec, 2), Path("run")))
    assert (rows["strategy"], rows["devices"]) == ("one_device on cuda:1", "cuda:1")
    spec = compose_and_validate(["cluster.device=cuda", "strategy=one_device"], 2)
    assert dict(plan.plan_rows(spec, Plan.resolve(spec, 2), Path("run")))["devices"] == "cuda:0"


def test_the_input_row_of_a_recipes_own_data_says_what_each_kind_of_data_becomes():
    """The plan is made before build(): it cannot know the data's kind, so it says what each kind becomes (a new
    user read `a dataset shuffled (seed 0), an iterable's own batches` as a description of their data)."""
    row = plan._input_summary(compose_and_validate(["cluster.device=cpu", "input.global_batch_size=32"], 0))
    assert row == ("the recipe's data (its kind is known once built): a map-style dataset is shuffled (seed 0) into "
                   "global batches of 32, an iterable gives its own; each global batch split across the replicas")
    unshuffled = plan._input_summary(compose_and_validate(["cluster.device=cpu", "input.shuffle=false"], 0))
    assert "a map-style dataset is read in order as global batches of 64" in unshuffled


def test_more_cpu_processes_than_cores_say_what_each_gets(monkeypatch):
    """cluster=1x64 on a 2-core machine planned 64 processes without a word."""
    import os

    from launcher.config.plan import Plan

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    rows = {}
    for shape, device in (("1x8", "cpu"), ("1x2", "cpu"), ("1x8", "cuda")):
        spec = compose_and_validate([f"cluster.device={device}", "strategy=mirrored", f"cluster={shape}"], 8)
        rows[shape, device] = dict(plan.plan_rows(spec, Plan.resolve(spec, 8), Path("run")))["processes"]
    assert rows["1x8", "cpu"].endswith("; [yellow]8 processes on this machine's 2 CPU core(s): each gets about 1/4 of a core[/]")
    assert "core" not in rows["1x2", "cpu"] and "core" not in rows["1x8", "cuda"]


def test_file_shards_of_which_one_fills_no_batch_are_a_config_error(tmp_path):
    """9 elements in 3 files, a global batch of 8 over 2 workers: rank 1's 3 elements fill none of its 4-row batches,
    so no epoch has a step. The dry run counted "after 0 steps" and exited 0; the run failed with NoBatch's "smaller
    than one global batch", 9 >= 8 notwithstanding."""
    import torch

    from launcher.config.errors import ConfigError
    from launcher.input.files import write_file

    for i in range(3):
        write_file(tmp_path / f"part-{i}.jsonl", {"x": torch.arange(3.0).unsqueeze(1), "y": torch.zeros(3, 1)})
    spec = compose_and_validate(["cluster.device=cpu", "strategy=mirrored", "cluster=1x2", "input.auto_shard_policy=file",
                                 f"input.files={tmp_path}/part-*.jsonl", "input.global_batch_size=8"], 0)
    with pytest.raises(ConfigError) as caught:
        plan.shard_table(spec)
    (problem,) = caught.value.problems
    assert problem.key == "input.auto_shard_policy" and problem.message == (
        "FILE gives each of the 2 workers its own files, and every epoch ends with the shortest worker's: rank 1 reads "
        "3 element(s), fewer than its 4 of each global batch (input.global_batch_size=8), so no step would have a batch; "
        "use more, equal-sized files, a smaller input.global_batch_size, or input.auto_shard_policy=DATA")
