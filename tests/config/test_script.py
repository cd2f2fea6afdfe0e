"""``script=PATH``'s config: the trainer keys a script does not honour are refused, each with what to do instead."""

from __future__ import annotations

import shutil

from launcher.config import script
from launcher.config.trainer import TrainerSpec
from tests.conftest import FIXTURES, dlaunch

LOOP = FIXTURES / "custom_loop.py"


def test_every_trainer_key_but_the_seed_precision_and_recompute_is_one_a_script_does_not_honour_and_says_why():
    honoured = {"seed", "precision", "activation_checkpointing"}  # the last two by strategy.autocast() and prepare()
    assert set(script.INSTEAD) == set(TrainerSpec.model_fields) - honoured  # a new trainer key needs its reason


def test_trainer_keys_a_script_does_not_honour_are_refused_in_one_screen(tmp_path):
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc = dlaunch("script=custom_loop.py", "trainer.compile.enabled=true", "trainer.grad_accum_steps=4",
                   "trainer.clip_grad_norm=1.0", "trainer.checkpoint.every_steps=10", "trainer.steps=10",
                   "--", "--epochs", "1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "5 problems" in proc.stderr and "Traceback" not in proc.stderr
    for key, why in (("trainer.compile.enabled = true", "torch.compile"), ("trainer.grad_accum_steps = 4", "strategy.no_sync(model)"),
                     ("trainer.clip_grad_norm = 1.0", "strategy.clip_grad_norm_(model, optimizer, max_norm)"),
                     ("trainer.checkpoint.every_steps = 10", "torch.save"),
                     ("trainer.steps = 10", "-- --steps N")):
        assert key in proc.stderr and why in proc.stderr, key
    assert not (tmp_path / "outputs").exists()  # refused before anything ran


def test_the_keys_a_script_honours_or_that_mean_nothing_to_it_are_accepted(tmp_path):
    """trainer.seed seeds the RNGs; trainer.precision reaches the script's strategy.autocast(), and
    trainer.activation_checkpointing its strategy.prepare(); resume=never (and auto,
    what dlaunch resume adds) change nothing for a script. The default recipe's YAML (trainer.steps=200) is not
    composed into a script's run, so it is not held against it."""
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc = dlaunch("script=custom_loop.py", "trainer.seed=3", "trainer.resume=never", "trainer.precision=bf16-mixed",
                   "trainer.activation_checkpointing=[Linear]", "launch.dry_run=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "custom_loop.py (as __main__" in proc.stdout and "Linear in backward" in proc.stdout


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


def test_fp16_is_refused_for_a_script_where_the_strategy_refuses_it_for_its_loop(tmp_path):
    """strategy.grad_scaler() under FSDP would meet what the loop's GradScaler does: ranks that skip different steps."""
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc = dlaunch("script=custom_loop.py", "strategy=fsdp", "trainer.precision=fp16-mixed", "launch.dry_run=true", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = " ".join(proc.stderr.split())
    assert "trainer.precision = fp16-mixed" in said and "strategy fsdp cannot do this: GradScaler checks only this rank's" in said


def test_recompute_is_refused_for_a_script_over_replica_threads(tmp_path):
    """strategy.prepare() would meet what the loop's does: replica threads sharing the CPU's random generator."""
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc = dlaunch("script=custom_loop.py", "strategy=central_storage", "strategy.compute_devices=[cpu:0,cpu:1]",
                   "trainer.activation_checkpointing=[Linear]", "launch.dry_run=true", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = " ".join(proc.stderr.split())
    assert "trainer.activation_checkpointing = ['Linear']" in said and "threads of one process" in said, said


def test_a_script_in_the_users_own_primary_config_takes_the_recipes_place_too(tmp_path):
    """As `script=` on the command line: the default recipe's YAML (trainer.steps=200) is not composed in, where it was
    refused as a trainer key the script had been given."""
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "myrun.yaml").write_text("defaults:\n  - config\n  - _self_\nscript:\n  path: custom_loop.py\n"
                                                 "  args: [--epochs, '1']\ntrainer:\n  seed: 3\n")
    proc = dlaunch("--config-dir", "cfg", "--config-name", "myrun", "launch.dry_run=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "custom_loop.py --epochs 1 (as __main__" in proc.stdout


def test_script_path_beside_script_keys_is_set_as_script_path():
    """Hydra lets the later of `script=PATH` and `script.args=[...]` replace the other whole; a delete stays one."""
    from launcher.config.script import path_beside_keys

    assert path_beside_keys(["script=a.py", "script.args=[--lr,1],[--lr,2]"]) == \
        ["script.path=a.py", "script.args=[--lr,1],[--lr,2]"]
    assert path_beside_keys(["+script=a.py", "script.args=[]"])[0] == "script.path=a.py"
    for kept in (["script=a.py", "trainer.seed=1"], ["~script=a.py", "script.args=[]"], ["~script", "script.args=[]"]):
        assert path_beside_keys(kept) == kept


def test_a_script_with_a_syntax_error_is_refused_before_any_worker_starts_in_one_line(tmp_path):
    """As a recipe's: compiled (not run) by dlaunch itself, so no worker starts and no dlaunch frame is shown."""
    (tmp_path / "syn.py").write_text("import torch\ndef f(:\n    pass\n")
    proc = dlaunch("script=syn.py", "strategy=mirrored", "cluster=1x2", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{tmp_path / 'syn.py'}:2: SyntaxError: " in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "starting" not in proc.stdout + proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_scripts_command_is_shown_as_a_shell_takes_it(tmp_path):
    """`--name 'my run'` was shown (plan, summary.json, the sweep table) as `--name my run`: two arguments."""
    from launcher.config.script import ScriptSpec

    path = tmp_path / "train.py"
    path.write_text("pass\n")
    assert ScriptSpec(path=str(path), args=["--name", "my run", "--lr", "0.1"]).command() == "train.py --name 'my run' --lr 0.1"


def test_dlaunch_settings_typed_after_the_separator_are_said_to_go_to_the_script(tmp_path):
    """`dlaunch script=train.py -- --epochs 1 strategy=mirrored cluster=1x2 launch.dry_run=true` ran the script on
    one_device (the settings were its arguments), with no word."""
    assert script.like_settings(["--epochs", "1", "strategy=mirrored", "+trainer.steps=3", "lr=0.1", "x.y=1"]) == [
        "strategy=mirrored", "+trainer.steps=3"]
    shutil.copy(FIXTURES / "torchrun_script.py", tmp_path / "train.py")
    proc = dlaunch("script=train.py", "launch.dry_run=true", "--", "--epochs", "1", "cluster=1x2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("dlaunch: cluster=1x2 after -- go to the script as its own arguments, not to dlaunch; dlaunch's settings go "
            "before --") in proc.stderr
