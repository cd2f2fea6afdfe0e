"""The key an unknown override most likely meant (launcher/config/unknown_keys.py), on a config of its own."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from launcher.config.unknown_keys import unknown_key_problem

TREE = OmegaConf.create({
    "trainer": {"steps": 10, "seed": 0, "lr_schedule": {"warmup_steps": 0}, "profile": {"step": 3}},
    "input": {"global_batch_size": 64, "seed": 0},
    "recipe": {"optimizer": {"lr": 0.1, "name": "sgd"}, "width": 8},
    "cluster": {"nodes": 1, "master_addr": "???"},
    "hydra": {"seed": 5, "steps": 1},
})


@pytest.mark.parametrize("key, guess", [
    ("trainer.stpes", "trainer.steps"),  # a typo of a sibling
    ("trainer.step", "trainer.steps"),  # ... beats trainer.profile.step one section down
    ("trainer.warmup_steps", "trainer.lr_schedule.warmup_steps"),  # the same name one section down
    ("trainer.lr", "recipe.optimizer.lr"),  # the same name anywhere beats lr_schedule, which merely begins with it
    ("optimizer.lr", "recipe.optimizer.lr"),  # a path's end
    ("seed", "trainer.seed or input.seed"),  # every match at the shallowest depth; Hydra's own section left out
    ("trainer.batch_size", "input.global_batch_size"),  # a name anywhere spelled like it
    ("max_steps", "trainer.steps"),
    ("trainr.steps", "trainer.steps"),
    ("trainer.foo", None),
    ("recipe.optimizer.nesterov.x", None),  # under an unknown key: no spelled-like guess for the rest
])
def test_the_guess_for_an_unknown_key(key, guess):
    problem = unknown_key_problem(TREE, key, 1)
    assert problem is not None and problem.suggestion == guess
    assert "hydra" not in problem.allowed


def test_a_key_that_exists_is_no_problem_and_a_missing_value_is_not_resolved():
    assert unknown_key_problem(TREE, "recipe.optimizer.lr", 1) is None
    assert unknown_key_problem(TREE, "cluster.master_adr", 1).suggestion == "cluster.master_addr"  # its ??? unread


def test_a_key_of_another_strategy_names_the_strategies_that_have_it():
    """`strategy.bucket_cap_mb=1` under one_device said `allowed: name, device` and nothing of mirrored."""
    tree = OmegaConf.create({"strategy": {"name": "one_device", "device": None}})
    assert unknown_key_problem(tree, "strategy.bucket_cap_mb", 1).message == (
        "unknown key under strategy (a key of strategy=mirrored, multi_worker_mirrored)")
    assert unknown_key_problem(tree, "strategy.bucket_cap", 1).message == "unknown key under strategy"
    assert unknown_key_problem(TREE, "trainer.bucket_cap_mb", 1).message == "unknown key under trainer"
