"""What a checkpoint's manifest records, and what a resume is told changed since (``manifest.changes``)."""

from __future__ import annotations

from launcher.checkpoint import manifest
from launcher.config.compose import compose_and_validate
from launcher.input.position import Position

COSINE = ("trainer.lr_schedule.decay=cosine", "trainer.lr_schedule.warmup_steps=10", "cluster.device=cpu")


def saved(*overrides: str) -> dict:
    return manifest.build(compose_and_validate([*COSINE, *overrides], 0), 40, Position(0, 40))


def test_a_longer_run_says_its_lr_schedule_stretched_and_how_to_keep_it():
    longer = compose_and_validate([*COSINE, "trainer.steps=80"], 0)
    (change,) = [c for c in manifest.changes(saved("trainer.steps=40"), longer) if c.startswith("lr schedule")]
    assert change.startswith("lr schedule: cosine decay over 30 -> cosine over 70 steps after the warm-up: from step 40")
    assert "trainer.lr_schedule.decay_steps=30 keeps the saved length" in change
    kept = compose_and_validate([*COSINE, "trainer.steps=80", "trainer.lr_schedule.decay_steps=30"], 0)
    assert not [c for c in manifest.changes(saved("trainer.steps=40"), kept) if c.startswith("lr schedule")]


def test_a_constant_lr_or_a_checkpoint_from_before_has_nothing_to_say():
    constant = compose_and_validate(["cluster.device=cpu", "trainer.steps=80"], 0)
    old = manifest.build(compose_and_validate(["cluster.device=cpu", "trainer.steps=40"], 0), 40, Position(0, 40))
    assert manifest.changes(old, constant) == []
    older = {k: v for k, v in saved("trainer.steps=40").items() if k != "lr_decay"}  # written before lr_decay was recorded
    assert manifest.changes(older, compose_and_validate([*COSINE, "trainer.steps=80"], 0)) == []


def test_a_shorter_run_is_told_too_without_a_length_it_could_not_keep():
    shorter = compose_and_validate([*COSINE, "trainer.steps=30"], 0)  # 10 + 30 > 30: decay_steps=30 would be refused
    (change,) = [c for c in manifest.changes(saved("trainer.steps=40"), shorter) if c.startswith("lr schedule")]
    assert "cosine decay over 30 -> cosine over 20 steps" in change and "decay_steps" not in change


def test_a_recipe_key_left_at_its_default_is_compared_as_its_config_reads_it():
    """A YAML without ``noise`` ran with the Config's 0.1: setting 0.1 is no change, 0.2 is (it said None -> 0.1)."""
    old = saved()
    del old["recipe"]["noise"]
    same = compose_and_validate([*COSINE, "recipe.noise=0.1"], 0)
    assert not [c for c in manifest.changes(old, same) if c.startswith("recipe.")]
    other = compose_and_validate([*COSINE, "recipe.noise=0.2"], 0)
    assert [c for c in manifest.changes(old, other) if c.startswith("recipe.")] == ["recipe.noise: 0.1 -> 0.2"]


def test_a_new_global_batch_on_as_many_replicas_says_so_once():
    old = saved("input.global_batch_size=64")
    (change,) = [c for c in manifest.changes(old, compose_and_validate([*COSINE, "input.global_batch_size=32"], 0))
                 if c.startswith("per-replica")]
    assert change == "per-replica batch 64 -> 32 (on 1 replica(s))"


def test_what_changes_how_a_step_trains_is_listed_and_a_checkpoint_from_before_says_nothing_of_it():
    before = saved("trainer.steps=40", "trainer.grad_accum_steps=2")
    after = compose_and_validate([*COSINE, "trainer.steps=40", "trainer.grad_accum_steps=4", "trainer.clip_grad_norm=1.0",
                                  "trainer.precision=bf16-mixed", "trainer.log_every=5"], 0)
    assert manifest.changes(before, after) == [
        "trainer.clip_grad_norm: null -> 1.0", "trainer.grad_accum_steps: 2 -> 4", "trainer.precision: fp32 -> bf16-mixed"]
    older = {k: v for k, v in before.items() if k != "trainer"}  # written before the trainer settings were recorded
    assert manifest.changes(older, after) == []
