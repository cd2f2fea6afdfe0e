"""A user's recipe by name (--config-dir DIR/recipe/NAME.yaml) or by path, composed as a run composes it."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher.cli import recipes
from launcher.config import compose as composer
from launcher.config.errors import ConfigError, UserCodeError
from tests.conftest import ROOT, dlaunch, summary


def test_a_recipe_yamls_input_files_and_a_key_given_twice_are_named_with_the_file(tmp_path, capsys, monkeypatch):
    """input.files set in the YAML and not found said nothing of the YAML (its value is a list of one pattern there);
    a second `input:` section (a key given twice) was a traceback from OmegaConf's loader, after yaml.safe_load had
    quietly kept the last one."""
    assert recipes.main(["cp", "linear", str(tmp_path / "mine") + "/"]) == 0
    capsys.readouterr()
    yaml_path = tmp_path / "mine" / "recipe" / "linear.yaml"
    original = yaml_path.read_text()
    yaml_path.write_text(original.replace("input:\n", "input:\n  files: data/train.csv\n", 1))
    monkeypatch.chdir(tmp_path)
    text = problems_of(["recipe=mine/recipe/linear.yaml"])
    assert f"no file matches 'data/train.csv' (looked in {tmp_path / 'data'}), set in {yaml_path}" in text, text
    yaml_path.write_text(original + "input:\n  files: data/train.csv\n")
    text = problems_of(["recipe=mine/recipe/linear.yaml"])
    first = original.splitlines().index("input:") + 1
    assert f"cannot read this YAML: 'input' is given twice in one mapping (first at line {first})" in text, text


@pytest.fixture
def config_dirs():
    saved = list(composer.CONFIG_DIRS)
    yield composer.CONFIG_DIRS
    composer.CONFIG_DIRS[:] = saved


def renamed_copy(tmp_path: Path, capsys) -> Path:
    """``dlaunch recipes cp digits``, then both files renamed mydigits (and the entry with them), as a user would."""
    assert recipes.main(["cp", "digits", str(tmp_path / "copy") + "/"]) == 0
    capsys.readouterr()
    renamed = tmp_path / "renamed"
    (renamed / "recipe").mkdir(parents=True)
    (tmp_path / "copy" / "digits.py").rename(renamed / "mydigits.py")
    text = (tmp_path / "copy" / "recipe" / "digits.yaml").read_text().replace("../digits.py", "../mydigits.py")
    (renamed / "recipe" / "mydigits.yaml").write_text(text)
    return renamed


def spec_of(overrides: list[str]):
    return composer.compose_and_validate(composer.choose_user_recipes(overrides), cuda_devices=0)


def test_a_renamed_copy_validates_and_runs_under_its_new_name(tmp_path, capsys):
    renamed = renamed_copy(tmp_path, capsys)
    assert recipes.main(["validate", str(renamed), "--cuda-devices", "0"]) == 0
    out = capsys.readouterr().out
    declared = OmegaConf.load(ROOT / "recipes" / "digits.yaml").recipe.strategies
    assert out.count("ok  ") == len(declared) and "FAIL" not in out, out
    run_dir = tmp_path / "run"
    proc = dlaunch("--config-dir", "renamed", "recipe=mydigits", "trainer.steps=5", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(run_dir)["status"] == "completed" and summary(run_dir)["steps"] == 5
    assert "mydigits" in (run_dir / "config.yaml").read_text()


def test_a_config_dir_recipe_replaces_the_default_and_its_entry_is_relative_to_the_yaml(tmp_path, config_dirs, monkeypatch):
    (tmp_path / "cfg" / "recipe").mkdir(parents=True)
    (tmp_path / "cfg" / "recipe" / "mine.yaml").write_text(
        "# dlaunch --config-dir cfg recipe=mine\nrecipe:\n  entry: ../../code/mine.py\n  strategies: [one_device]\n")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "mine.py").write_text(composer.recipe_files()["linear"].with_suffix(".py").read_text())
    monkeypatch.chdir(tmp_path / "code")  # not where the YAML is: the entry still resolves
    config_dirs[:] = [str(tmp_path / "cfg")]
    spec = spec_of(["recipe=mine"])
    assert spec.recipe.name == "mine" and spec.recipe.entry == str(tmp_path / "code" / "mine.py")
    assert spec.recipe.strategies == ["one_device"]
    assert "features" not in spec.recipe.model_dump()  # nothing merged in from the default recipe=linear


def test_a_recipe_by_path_to_its_py_or_its_yaml(tmp_path, capsys, monkeypatch):
    assert recipes.main(["cp", "linear", str(tmp_path / "mine") + "/"]) == 0
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    by_yaml = spec_of(["recipe=mine/recipe/linear.yaml", "strategy=mirrored", "cluster=1x2"])
    assert by_yaml.recipe.entry == str(tmp_path / "mine" / "linear.py") and by_yaml.recipe.name == "linear"
    by_py = spec_of(["recipe=mine/linear.py"])
    assert by_py.recipe.entry == str(tmp_path / "mine" / "linear.py")
    # the .py of a copy takes the settings cp wrote for it (recipe/linear.yaml): they were ignored, Config's defaults ran
    yaml_file = tmp_path / "mine" / "recipe" / "linear.yaml"
    yaml_file.write_text(yaml_file.read_text().replace("features: 32", "features: 5"))
    assert spec_of(["recipe=mine/linear.py"]).recipe.features == spec_of(["recipe=mine/recipe/linear.yaml"]).recipe.features == 5
    (tmp_path / "mine" / "linear.yaml").write_text("recipe:\n  features: 3\n")  # one beside the .py comes first
    assert spec_of(["recipe=mine/linear.py"]).recipe.features == 3


def test_a_moved_copy_runs_by_path(tmp_path, capsys):
    assert recipes.main(["cp", "linear", str(tmp_path / "mine") + "/"]) == 0
    capsys.readouterr()
    (tmp_path / "mine").rename(tmp_path / "moved")  # relocatable: the entry is relative to the YAML
    run_dir = tmp_path / "run"
    proc = dlaunch("recipe=moved/recipe/linear.yaml", "trainer.steps=3", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(run_dir)["steps"] == 3


def test_a_relative_recipe_entry_is_found_from_a_jobs_own_directory(tmp_path, capsys):
    """`recipe.entry=mine.py` with hydra.job.chdir=true: the run imported `mine.py` from its run directory
    (`recipe file mine.py does not exist`); the validated entry is absolute, from where dlaunch started."""
    assert recipes.main(["cp", "linear", str(tmp_path) + "/"]) == 0
    capsys.readouterr()
    (tmp_path / "linear.py").rename(tmp_path / "mine.py")
    run_dir = tmp_path / "run"
    proc = dlaunch("recipe.entry=mine.py", "trainer.steps=3", "hydra.job.chdir=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(run_dir)["steps"] == 3
    assert OmegaConf.load(run_dir / "config.yaml").recipe.entry == str(tmp_path / "mine.py")


def problems_of(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        spec_of(overrides)
    return "\n".join(f"{p.key} = {p.value}: {p.message}" for p in caught.value.problems)


def test_bad_recipe_files_name_the_file(tmp_path, config_dirs, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = problems_of(["recipe=nowhere/mine.py"])
    assert f"recipe file {tmp_path / 'nowhere' / 'mine.py'} does not exist" in text
    (tmp_path / "noentry.yaml").write_text("recipe:\n  strategies: [one_device]\n")
    assert f"required key is missing in {tmp_path / 'noentry.yaml'}" in problems_of(["recipe=noentry.yaml"])
    (tmp_path / "other.yaml").write_text("trainer:\n  steps: 3\n")
    assert "not a recipe config" in problems_of(["recipe=other.yaml"])
    text = problems_of(["recipe=mydigits"])
    assert "unknown recipe" in text and "--config-dir" in text


def test_a_config_dir_that_is_the_recipe_folder_itself_is_told_to_give_its_parent(tmp_path, config_dirs):
    """``--config-dir proj/recipe`` for ``proj/recipe/mine.yaml``: an easy slip that the message named nothing of."""
    (tmp_path / "proj" / "recipe").mkdir(parents=True)
    (tmp_path / "proj" / "recipe" / "mine.yaml").write_text("recipe:\n  entry: launcher.recipes.linear\n")
    config_dirs[:] = [str(tmp_path / "proj" / "recipe")]
    text = problems_of(["recipe=mine"])
    assert f"mine.yaml is in {tmp_path / 'proj' / 'recipe'} itself: give its parent, --config-dir {tmp_path / 'proj'}" in text
    config_dirs[:] = [str(tmp_path / "proj")]
    assert spec_of(["recipe=mine"]).recipe.name == "mine"


def test_an_unknown_key_a_recipe_yaml_sets_is_named_with_its_file(tmp_path, capsys, monkeypatch):
    """A typo in the YAML is not on the command line: the screen says which file to edit; a typed one is not blamed
    on the file."""
    assert recipes.main(["cp", "linear", str(tmp_path / "mine") + "/"]) == 0
    capsys.readouterr()
    yaml_path = tmp_path / "mine" / "recipe" / "linear.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("  noise:", "  nois:").replace("  steps:", "  stepz:"))
    monkeypatch.chdir(tmp_path)
    text = problems_of(["recipe=mine/recipe/linear.yaml", "recipe.featurs=3"])
    assert f"recipe.nois = 0.1: unknown key, set in {yaml_path}" in text, text
    assert f"trainer.stepz = 200: unknown key, set in {yaml_path}" in text, text
    assert "recipe.featurs = 3: unknown key\n" in text + "\n", text


def test_a_new_entry_under_the_default_recipe_names_where_its_unknown_keys_came_from(tmp_path, monkeypatch, capsys):
    """`recipe.entry=mine.py` alone keeps the default recipe's settings (linear's features, noise, ...), which the new
    code's Config lacks: each unknown key says so and gives the selection that brings the file's own settings."""
    (tmp_path / "mine.py").write_text("from launcher.runtime.recipe import RecipeConfig\n\n\nclass Config(RecipeConfig):\n"
                                      "    rows: int = 3\n\n\ndef build(cfg, ctx):\n    ...\n\n\n"
                                      "def train_step(model, batch):\n    ...\n")
    monkeypatch.chdir(tmp_path)
    from launcher.cli import main as cli

    assert cli.main(["recipe.entry=mine.py", "recipe.rows=5", "cluster.device=cpu"]) == 2
    text = capsys.readouterr().err
    said = "unknown key, the linear recipe's (recipe.entry keeps its settings; `recipe=mine.py` brings the file's own)"
    for key in ("recipe.features = 32", "recipe.noise = 0.1", "recipe.eval_examples = 1024"):
        assert f"{key}: {said}" in text, text  # eight problems: each on one line
    assert "recipe.rows" not in text and len(text.splitlines()) <= 25  # typed, and the file's Config has it


def test_a_bad_value_a_recipe_yaml_sets_is_named_with_its_file(tmp_path, capsys, monkeypatch):
    """A wrong type or an out-of-range value in the YAML was reported as if typed: the screen says which file too."""
    assert recipes.main(["cp", "linear", str(tmp_path / "mine") + "/"]) == 0
    capsys.readouterr()
    yaml_path = tmp_path / "mine" / "recipe" / "linear.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("  noise: 0.1", "  noise: lots").replace("  steps: 200", "  steps: -5"))
    monkeypatch.chdir(tmp_path)
    lines = problems_of(["recipe=mine/recipe/linear.yaml"]).splitlines()
    noise = next(line for line in lines if line.startswith("recipe.noise = lots: "))
    steps = next(line for line in lines if line.startswith("trainer.steps = -5: "))
    assert noise.endswith(f", set in {yaml_path}") and steps.endswith(f", set in {yaml_path}"), lines
    typed = problems_of(["recipe=mine/recipe/linear.yaml", "trainer.steps=0"]).splitlines()
    assert not next(line for line in typed if line.startswith("trainer.steps = 0: ")).endswith(str(yaml_path)), typed


def test_a_recipe_that_raises_at_import_is_the_users_code_failing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("import math\n\nraise RuntimeError('no data here')\n")
    with pytest.raises(UserCodeError) as caught:
        spec_of(["recipe=broken.py"])
    assert caught.value.exit_code == 1
    assert "RuntimeError: no data here" in caught.value.problems[0].message
    assert f"{tmp_path / 'broken.py'}:3" in caught.value.problems[0].message


@pytest.mark.parametrize("other", ["trainer.steps=-1", "trainer.stpes=5"], ids=["bad-value", "unknown-key"])
def test_a_recipe_that_raises_at_import_is_named_beside_the_commands_config_problems(tmp_path, monkeypatch, other):
    """A new user fixed `trainer.stpes=5`, then met the import error, then the next: three tries for one screen's
    worth. Beside config problems (exit 2), the recipe's failed import is one of them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("import math\n\nraise RuntimeError('no data here')\n")
    with pytest.raises(ConfigError) as caught:
        spec_of(["recipe=broken.py", other])
    assert caught.value.exit_code == 2 and not isinstance(caught.value, UserCodeError)
    keys = [p.key for p in caught.value.problems]
    assert keys == [other.split("=")[0], "recipe.entry"], keys
    assert f"RuntimeError: no data here at import ({tmp_path / 'broken.py'}:3)" in caught.value.problems[1].message


def test_three_independent_mistakes_are_reported_together():
    text = problems_of(["trainer.steps=-1", "input.global_batch_size=65", "strategy=mirrored", "cluster=1x3",
                        "recipe.optimizer.lr=abc", "trainer.stpes=2"])
    for expected in ("trainer.steps = -1", "global_batch_size 65 is not divisible by 3", "recipe.optimizer.lr = abc",
                     "trainer.stpes = 2: unknown key"):
        assert expected in text, text


def test_a_rule_about_a_key_at_fault_judges_no_default():
    text = problems_of(["input.global_batch_size=abc", "strategy=mirrored", "cluster=1x3"])
    assert "input.global_batch_size = abc" in text and "divisible" not in text, text


def test_a_config_field_the_yaml_leaves_out_is_set_like_any_other(tmp_path, capsys, config_dirs):
    """recipe.noise is a field of linear's Config; the copy's YAML no longer lists it (its default stands)."""
    assert recipes.main(["cp", "linear", str(tmp_path / "p") + "/"]) == 0
    capsys.readouterr()
    yaml_path = tmp_path / "p" / "recipe" / "linear.yaml"
    yaml_path.write_text("".join(line for line in yaml_path.read_text().splitlines(True) if not line.startswith("  noise:")))
    config_dirs[:] = [str(tmp_path / "p")]
    chosen = composer.choose_user_recipes(["recipe=linear", "recipe.noise=0.25", "recipe.optimizer.lr=0.5", "trainer.steps=2"])
    assert "+recipe.noise=0.25" in chosen and "recipe.optimizer.lr=0.5" in chosen  # the YAML lists optimizer.lr
    spec = composer.compose_and_validate(chosen, 0)
    assert spec.recipe.noise == 0.25 and spec.recipe.optimizer["lr"] == 0.5

    typo = dlaunch("--config-dir", str(tmp_path / "p"), "recipe=linear", "recipe.nois=0.25", cwd=tmp_path)
    assert typo.returncode == 2 and "Traceback" not in typo.stderr
    text = " ".join(typo.stderr.split())
    assert "recipe.nois = 0.25" in text and "did you mean recipe.noise?" in text and "noise, optimizer" in text
    section = dlaunch("--config-dir", str(tmp_path / "p"), "recipe=linear", "recipe.features.x=1", cwd=tmp_path)
    assert section.returncode == 2 and "recipe.features.x = 1" in section.stderr  # features is a number, not a section
    swept = dlaunch("-m", "--config-dir", str(tmp_path / "p"), "recipe=linear", "recipe.noise=0.1,0.2", "trainer.steps=2",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert swept.returncode == 0, swept.stderr[-3000:]
    assert [OmegaConf.load(tmp_path / "sweep" / str(i) / "config.yaml").recipe.noise for i in (0, 1)] == [0.1, 0.2]


def test_a_whole_section_the_yaml_leaves_out_is_set_like_any_other(tmp_path, capsys, config_dirs):
    """The copy's YAML has no optimizer section at all: recipe.optimizer.lr still sets the Config's optimizer."""
    assert recipes.main(["cp", "linear", str(tmp_path / "p") + "/"]) == 0
    capsys.readouterr()
    yaml_path = tmp_path / "p" / "recipe" / "linear.yaml"
    text = yaml_path.read_text()
    yaml_path.write_text(text[:text.index("  optimizer:")] + text[text.index("input:"):])
    config_dirs[:] = [str(tmp_path / "p")]
    chosen = composer.choose_user_recipes(["recipe=linear", "recipe.optimizer.lr=0.5", "recipe.optimizer.name=adam"])
    assert chosen[1:] == ["+recipe.optimizer.lr=0.5", "+recipe.optimizer.name=adam"]
    spec = composer.compose_and_validate(chosen, 0)
    assert spec.recipe.optimizer == {"lr": 0.5, "name": "adam"}
    from launcher.runtime.recipe import load

    optimizer = load(spec.recipe.model_dump()).config.optimizer  # the rest of the section: the recipe's defaults
    assert (optimizer.name, optimizer.lr, optimizer.momentum) == ("adam", 0.5, 0.9)
    typo = dlaunch("--config-dir", str(tmp_path / "p"), "recipe=linear", "recipe.optimzer.lr=0.5", cwd=tmp_path)
    assert typo.returncode == 2 and "Traceback" not in typo.stderr
    assert "recipe.optimzer.lr = 0.5" in typo.stderr and "did you mean recipe.optimizer.lr?" in typo.stderr


@pytest.mark.parametrize("choice", [[], *([f"recipe={n}"] for n in composer.recipe_files())])
def test_a_shipped_recipes_section_is_read_without_composing_and_is_what_composing_gives(choice, monkeypatch, config_dirs):
    """chosen_recipe reads a shipped recipe's YAML, once per process (a sweep checks every job's keys against it):
    the section Hydra composes for the choice, to the letter, and no compose runs for it."""
    config_dirs[:] = []  # dlaunch's own configs (an earlier main() in this process may have left a --config-dir)
    monkeypatch.setattr(composer, "CONFIG_NAME", "config")
    composed = OmegaConf.to_container(composer.compose(choice).recipe)

    def no_compose(overrides):
        raise AssertionError(f"composed {overrides}")

    monkeypatch.setattr(composer, "compose", no_compose)
    assert OmegaConf.to_container(composer.chosen_recipe(choice)) == composed


def test_a_config_dirs_recipe_section_is_composed(tmp_path, capsys, config_dirs):
    """Under --config-dir the recipe of that name may be the user's own: its section is composed, not dlaunch's read."""
    assert recipes.main(["cp", "linear", str(tmp_path / "p") + "/"]) == 0
    capsys.readouterr()
    yaml_path = tmp_path / "p" / "recipe" / "linear.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("  features:", "  extra_key: 1\n  features:"))
    assert "+recipe.extra_key=2" in composer.choose_user_recipes(["recipe=linear", "recipe.extra_key=2"])  # dlaunch's
    config_dirs[:] = [str(tmp_path / "p")]
    assert "recipe.extra_key=2" in composer.choose_user_recipes(["recipe=linear", "recipe.extra_key=2"])  # the user's


def test_with_a_swept_recipe_choice_a_recipe_key_is_set_or_added_per_job(config_dirs):
    chosen = composer.choose_user_recipes(["recipe=linear,digits", "recipe.optimizer.lr=0.5", "+recipe.x=1", "trainer.steps=2"])
    assert chosen == ["recipe=linear,digits", "++recipe.optimizer.lr=0.5", "+recipe.x=1", "trainer.steps=2"]


def test_tables_show_a_recipe_key_as_typed_without_the_plus_dlaunch_added():
    from launcher.config.user_recipes import as_shown

    assert as_shown(["+recipe.hidden=8", "++recipe.lr=0.1", "+trainer.extra=1", "recipe=linear", "~recipe.noise"]) == [
        "recipe.hidden=8", "recipe.lr=0.1", "+trainer.extra=1", "recipe=linear", "~recipe.noise"]
