"""``script=PATH``'s config: the trainer keys a script does not honour are refused, each with what to do instead."""

from __future__ import annotations

import shutil

from launcher.config import script
from launcher.config.trainer import TrainerSpec
from tests.conftest import FIXTURES, dlaunch

LOOP = FIXTURES / "custom_loop.py"


def test_every_trainer_key_but_the_seed_is_one_a_script_does_not_honour_and_says_why():
    assert set(script.INSTEAD) == set(TrainerSpec.model_fields) - {"seed"}  # a new trainer key needs its reason


def test_trainer_keys_a_script_does_not_honour_are_refused_in_one_screen(tmp_path):
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc = dlaunch("script=custom_loop.py", "trainer.precision=bf16-mixed", "trainer.grad_accum_steps=4",
                   "trainer.clip_grad_norm=1.0", "trainer.checkpoint.every_steps=10", "trainer.steps=10",
                   "--", "--epochs", "1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "5 problems" in proc.stderr and "Traceback" not in proc.stderr
    for key, why in (("trainer.precision = bf16-mixed", "torch.autocast"), ("trainer.grad_accum_steps = 4", "accumulate"),
                     ("trainer.clip_grad_norm = 1.0", "clip_grad_norm_"), ("trainer.checkpoint.every_steps = 10", "torch.save"),
                     ("trainer.steps = 10", "-- --steps N")):
        assert key in proc.stderr and why in proc.stderr, key
    assert not (tmp_path / "outputs").exists()  # refused before anything ran


def test_the_keys_a_script_honours_or_that_mean_nothing_to_it_are_accepted(tmp_path):
    """trainer.seed seeds the RNGs; resume=never (and auto, what dlaunch resume adds) change nothing for a script. The
    default recipe's YAML (trainer.steps=200) is not composed into a script's run, so it is not held against it."""
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc = dlaunch("script=custom_loop.py", "trainer.seed=3", "trainer.resume=never", "launch.dry_run=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "custom_loop.py (as __main__" in proc.stdout


def test_a_recipe_chosen_or_set_beside_a_script_is_refused_not_ignored(tmp_path):
    """Its YAML's trainer.steps would be held against the script, and recipe.entry failed in Hydra with a traceback."""
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc = dlaunch("script=custom_loop.py", "recipe=linear", "recipe.entry=foo", "launch.dry_run=true", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "recipe = linear" in proc.stderr and "recipe.entry = foo" in proc.stderr
    assert "a script takes the recipe's place" in proc.stderr and "trainer.steps" not in proc.stderr


def test_a_script_path_with_a_typo_names_the_script_beside_it(tmp_path):
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc = dlaunch("script=custom_lop.py", cwd=tmp_path)
    assert proc.returncode == 2 and "no such file" in proc.stderr and "did you mean custom_loop.py?" in proc.stderr
