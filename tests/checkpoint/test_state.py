"""What a checkpoint holds of a rank: the user's module, found inside dlaunch's wrappers only."""

from __future__ import annotations

import torch

from launcher.checkpoint.state import unwrap
from tests.checkpoint.test_resume import final_state
from tests.conftest import FIXTURES, summary
from tests.fixtures.module_attr_recipe import Model


def test_a_users_own_submodule_named_module_is_not_unwrapped():
    model = Model(4)
    assert unwrap(model) is model


def test_mirrored_copies_are_unwrapped_to_the_users_module(strategy):
    with strategy.scope():
        model = strategy.prepare(Model(4))
    assert model is not unwrap(model) and isinstance(unwrap(model), Model)


def test_a_model_with_a_module_attribute_saves_evaluates_and_resumes(run_dlaunch):
    """It crashed in DCP's optimizer state (KeyError) and evaluated only its first layer before."""
    args = (f"recipe={FIXTURES / 'module_attr_recipe.py'}", "cluster.device=cpu", "trainer.checkpoint.every_steps=2")
    proc, run_dir = run_dlaunch(*args, "trainer.steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, _ = run_dlaunch(*args, "trainer.steps=6")  # the same directory: resumed from step 4
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = summary(run_dir)
    model, _ = final_state(run_dir)
    assert done["resumed_from_step"] == 4 and done["metrics"]["eval_loss"] > 0
    assert sorted(model) == ["head.bias", "head.weight", "module.bias", "module.weight"]  # the whole model, by its names
    whole = torch.cat([t.flatten() for t in model.values()]).norm().item()
    assert abs(done["param_norm"] - whole) < 1e-4 * whole  # every layer counted, the head too
