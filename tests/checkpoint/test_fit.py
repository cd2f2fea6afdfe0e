"""launcher.checkpoint.fit: the launcher compares the checkpoint's model shapes with the model a changed recipe
setting builds, before any process starts."""

from __future__ import annotations

import pytest
import torch

from launcher.checkpoint import Checkpointer, CheckpointError, fit
from launcher.config.compose import compose_and_validate
from launcher.input.position import Position
from launcher.recipes import linear


def saved_linear(tmp_path, features=32):
    spec = compose_and_validate(["cluster.device=cpu", f"recipe.features={features}", "trainer.steps=10"], cuda_devices=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(features, 1)
    return Checkpointer(spec, tmp_path, rank=0).save(5, Position(0, 5), model, torch.optim.SGD(model.parameters(), lr=0.1))


def spec_for(*overrides):
    return compose_and_validate(["cluster.device=cpu", "trainer.steps=10", *overrides], cuda_devices=0)


def test_a_setting_that_changes_a_shape_is_named_with_both_shapes(tmp_path):
    path = saved_linear(tmp_path)
    with pytest.raises(CheckpointError, match=r"model.weight is \[1, 32\] in the checkpoint and \[1, 16\] here; since "
                                              r"the checkpoint recipe.features: 32 -> 16"):
        fit.check_shapes(path, spec_for("recipe.features=16"), tmp_path)
    fit.check_shapes(path, spec_for("recipe.noise=0.5"), tmp_path)  # a setting that shapes nothing


def test_no_build_where_no_recipe_setting_changed(tmp_path, monkeypatch):
    path = saved_linear(tmp_path)
    monkeypatch.setattr(linear, "build", lambda cfg, ctx: pytest.fail("built although nothing changed"))
    fit.check_shapes(path, spec_for(), tmp_path)


def test_a_recipe_whose_build_fails_here_is_left_to_the_workers_load(tmp_path, monkeypatch):
    path = saved_linear(tmp_path)
    monkeypatch.setattr(linear, "build", lambda cfg, ctx: 1 / 0)
    fit.check_shapes(path, spec_for("recipe.features=16"), tmp_path)
