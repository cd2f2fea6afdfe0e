"""A recipe's own objects (Parts.objects) in its checkpoints: saved by every rank, restored on resume, refused early."""

from __future__ import annotations

import pytest
import torch

from launcher.checkpoint import layout, read_object
from launcher.checkpoint import objects as saved_objects
from launcher.distribute.extended import StrategyExtended
from tests.conftest import FIXTURES, dlaunch

EMA = FIXTURES / "ema_recipe.py"


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(), ("strategy=mirrored", "cluster=1x2")])
def test_a_resumed_recipe_finds_its_moving_average_as_it_was(run_dlaunch, tmp_path, shape):
    """6 steps straight, against 3 steps then `dlaunch resume RUN_DIR trainer.steps=6`: the same EMA at step 6 (torch's
    AveragedModel, which torch's optimizer step hook updates once a step, micro-batches or not), in one process and in
    each of two."""
    common = (f"recipe.entry={EMA}", "trainer.checkpoint.every_steps=3", "trainer.grad_accum_steps=2", *shape)
    proc, straight = run_dlaunch(*common, "trainer.steps=6", name="straight")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, stopped = run_dlaunch(*common, "trainer.steps=3", name="stopped")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = dlaunch("resume", str(stopped), "trainer.steps=6", cwd=tmp_path, device=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2 if shape else 1):  # mirrored 1x2: both ranks saved their own
        a = read_object(layout.step_dir(straight / "checkpoints", 6), "ema", rank)
        b = read_object(layout.step_dir(stopped / "checkpoints", 6), "ema", rank)
        assert int(a["n_averaged"]) == 6 and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _KeepsItsOwn(StrategyExtended):
    def save_checkpoint(self, model, path, progress) -> bool:  # parameter servers: on their ps tasks
        return True


def test_objects_are_refused_before_the_first_step_where_no_checkpoint_could_hold_them():
    ema = torch.optim.swa_utils.AveragedModel(torch.nn.Linear(2, 1))
    with pytest.raises(TypeError, match=r"Parts.objects \(ema\): this strategy saves its variables itself"):
        saved_objects.checked({"ema": ema}, _KeepsItsOwn(["cpu:0"]), rank=0, saving=True)
    assert saved_objects.checked({"ema": ema}, StrategyExtended(["cpu:0"]), rank=0, saving=True) == {"ema": ema}

    class NumpyState:
        def state_dict(self):
            import numpy as np

            return {"rng": np.random.get_state()}

        def load_state_dict(self, state):
            raise AssertionError("never")

    with pytest.raises(TypeError, match="holds more than tensors and plain data"):
        saved_objects.checked({"sampler": NumpyState()}, None, rank=0, saving=True)
    on_meta = torch.optim.swa_utils.AveragedModel(torch.nn.Linear(2, 1, device="meta"))  # init_from=rank0, rank 1
    with pytest.raises(TypeError, match="tensors on the meta device, which hold no values"):
        saved_objects.checked({"ema": on_meta}, None, rank=1, saving=True)
    assert saved_objects.checked({"sampler": NumpyState()}, None, rank=0, saving=False)  # no checkpoints: no need


def test_a_recipe_whose_parts_name_an_object_badly_is_told_which():
    from launcher.runtime.recipe import Parts, RecipeContractError, checked_parts

    parts = Parts(model=torch.nn.Linear(1, 1), optimizer=None, train_data=[], objects={"ema": torch.zeros(1)})
    with pytest.raises(RecipeContractError, match=r"returned Parts with objects\['ema'\]: a Tensor has no state_dict"):
        checked_parts(parts, build=_a_build)


def _a_build():
    """Stands for a recipe's build() in the message."""


def test_read_object_names_what_a_checkpoint_holds_when_the_name_is_not_there(tmp_path):
    from launcher.checkpoint import CheckpointError
    from launcher.checkpoint.scripts import ScriptCheckpoints

    model = torch.nn.Linear(2, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    path = ScriptCheckpoints(tmp_path).save(1, model, objects={"scaler": scaler})
    assert read_object(path, "scaler")["scale"] == 8.0
    with pytest.raises(CheckpointError, match=r"has no object 'ema' of rank 0 \(it has: objects.rank0.scaler\)"):
        read_object(path, "ema")


def test_the_docs_show_the_recipe_that_the_test_runs():
    from tests.conftest import ROOT

    assert EMA.read_text().strip() in (ROOT / "docs" / "RECIPES.md").read_text()
