"""``dlaunch recipes``: ls, cp (and running the copy from its own directory), validate."""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.cli import recipes, recipes_cp, recipes_validate
from launcher.cli.recipes import main
from launcher.config.compose import recipe_files
from tests.conftest import ROOT, dlaunch, summary

MARK = "EDITED-COPY-RAN"


def declared(path: Path) -> list[str]:
    return list(yaml.safe_load(path.read_text())["recipe"].get("strategies") or [])


def run_command_of(stdout: str) -> str:
    lines = stdout.splitlines()
    return lines[lines.index("run the copy:") + 1].strip()


def as_argv(command: str) -> list[str]:
    """The printed ``dlaunch ...`` command's arguments, for tests.conftest.dlaunch."""
    words = shlex.split(command)
    assert words[0] == "dlaunch", command
    return words[1:]


def edit_copy(py: Path) -> None:
    """The user's edit: a print at the start of build()."""
    text = py.read_text()
    tree = ast.parse(text)
    build = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build")
    lines = text.splitlines()
    first = build.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):  # keep the docstring first
        first = build.body[1]
    indent = " " * first.col_offset
    lines.insert(first.lineno - 1, f"{indent}print({MARK!r}, flush=True)")
    py.write_text("\n".join(lines) + "\n")


# ----- validate: every shipped recipe under every strategy it declares -----

@pytest.mark.parametrize("name", sorted(recipe_files()))
def test_every_shipped_recipe_validates_under_every_strategy_it_declares(name, capsys):
    path = recipe_files()[name]
    strategies = declared(path)
    assert strategies, f"recipe {name} declares no strategies (recipe.strategies)"
    code = main(["validate", str(path), "--cuda-devices", "0"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    for strategy in strategies:
        shape = " ".join(recipes_validate.STRATEGY_SHAPES.get(strategy, ()))
        assert f"ok    {strategy} {shape}".rstrip() in out, out
    assert "FAIL" not in out and not err


def test_on_a_one_gpu_machine_the_example_shapes_it_cannot_hold_are_checked_on_the_cpu(capsys, monkeypatch):
    """validate picks each strategy's example shape (mirrored 1x2, mesh 1x4): on a machine with one GPU, `auto` made
    those cuda runs that asked for more GPUs than there are, and every such recipe FAILed for validate's own choice."""
    monkeypatch.setattr(recipes_validate.gpus, "count", lambda: 1)
    path = recipe_files()["linear"]
    assert main(["validate", str(path)]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "ok    mirrored cluster=1x2 (on the CPU: this machine has 1 CUDA device)" in out, out
    assert "ok    one_device cluster=1x1\n" in out and "FAIL" not in out, out  # one fits: checked as a run would be
    # a device the user names is checked as asked: the machine's count then stands
    assert main(["validate", str(path), "strategy=mirrored", "cluster.device=cuda"]) == 2
    assert "asks for 2 CUDA devices per node, but this machine has 1" in capsys.readouterr().out


# ----- ls -----

def test_ls_shows_each_recipe_with_strategies_purpose_and_command(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # narrow: a command is never split, a purpose shows no RST markup
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert set(recipes.shipped()) == set(recipe_files())
    lines = out.splitlines()
    for name, path in recipe_files().items():
        doc = ast.get_docstring(ast.parse(path.with_suffix(".py").read_text()))
        purpose = recipes.plain(doc.strip().splitlines()[0].strip())
        command = path.read_text().splitlines()[0]
        assert command.startswith("# dlaunch ")
        at = lines.index(f"{name}  {purpose}")
        assert lines[at + 1] == f"  strategies: {', '.join(declared(path))}" and lines[at + 2] == f"  {command[2:]}", out
        info = recipes.describe(name, path)
        assert info.strategies == tuple(declared(path)) and info.command == command[2:]
    assert "``" not in out and "│" not in out


def test_ls_imports_no_recipe_and_no_torch(tmp_path):
    code = ("import sys; from launcher.cli.recipes import main; assert main(['ls']) == 0; "
            "loaded = [m for m in sys.modules if m.startswith('launcher.recipes.') or m == 'torch']; "
            "assert not loaded, loaded")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ----- cp -----

@pytest.mark.parametrize("name", sorted(recipe_files()))
def test_cp_writes_a_relocatable_copy_whose_first_line_runs_it(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["cp", name, "mine/"]) == 0
    out = capsys.readouterr().out
    py, config = tmp_path / "mine" / f"{name}.py", tmp_path / "mine" / "recipe" / f"{name}.yaml"
    source = recipe_files()[name]
    assert_copied_module(py, source.with_suffix(".py"), f"dlaunch --config-dir mine recipe={name}", "mine")
    text = config.read_text()
    copied, shipped = yaml.safe_load(text), yaml.safe_load(source.read_text())
    assert copied["recipe"].pop("entry") == f"../{name}.py" and "name" not in copied["recipe"]  # the file's stem names it
    assert copied == shipped  # nothing else changed
    command = run_command_of(out)
    assert shlex.split(command)[:4] == ["dlaunch", "--config-dir", "mine", f"recipe={name}"]
    assert text.splitlines()[0] == f"# {command}"


def test_cp_to_a_name_makes_the_recipe_of_that_name_ready_to_run(tmp_path, capsys, monkeypatch):
    """``cp linear mine`` made mine/linear.py, still the recipe linear: renaming it took three edits, and its YAML's
    first line still ran recipe=linear. A name (not a directory: one that exists, or DIR/) names the copy."""
    monkeypatch.chdir(tmp_path)
    assert main(["cp", "linear", "mine"]) == 0
    command = run_command_of(capsys.readouterr().out)
    py, config = tmp_path / "mine.py", tmp_path / "recipe" / "mine.yaml"
    assert_copied_module(py, recipe_files()["linear"].with_suffix(".py"), "dlaunch --config-dir . recipe=mine", ".", "mine")
    assert shlex.split(command)[:4] == ["dlaunch", "--config-dir", ".", "recipe=mine"]
    text = config.read_text()
    assert text.splitlines()[0] == f"# {command}" and "recipe=linear" not in text
    assert yaml.safe_load(text)["recipe"]["entry"] == "../mine.py"
    argv = [w for w in as_argv(command) if not w.startswith(("strategy=", "cluster"))]  # one device: quick
    proc = dlaunch(*argv, "trainer.steps=3", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["recipe"]
    assert (ran["name"], ran["entry"]) == ("mine", str(py))
    assert main(["cp", "digits", "sub/my_digits"]) == 0
    assert shlex.split(run_command_of(capsys.readouterr().out))[:4] == ["dlaunch", "--config-dir", "sub", "recipe=my_digits"]
    assert (tmp_path / "sub" / "my_digits.py").is_file() and (tmp_path / "sub" / "recipe" / "my_digits.yaml").is_file()
    (tmp_path / "config.yaml").write_text("trainer: {steps: 3}\n")  # --config-dir . would run it as the primary config
    assert main(["cp", "linear", "other"]) == 2
    assert "holds config.yaml" in refusal(capsys) and not (tmp_path / "other.py").exists()
    assert main(["cp", "linear", "no good"]) == 2
    assert "cannot name a recipe" in refusal(capsys)


def assert_copied_module(py: Path, source: Path, runs_copy: str, directory: str, name: str | None = None) -> None:
    """The copy is the shipped module, but its docstring's commands run the copy (they ran the shipped recipe)."""
    name = name or source.stem
    copied, shipped = py.read_text(), source.read_text()
    doc_end = shipped.index('"""', 3) + 3
    assert copied.endswith(shipped[doc_end:])  # the code itself: byte for byte
    doc = copied[: len(copied) - len(shipped) + doc_end]
    assert f"dlaunch recipe={source.stem}" not in doc and f"launcher.recipes.{source.stem}" not in doc, doc
    commands = [line.strip() for line in shipped[:doc_end].splitlines() if line.strip().startswith("dlaunch recipe=")]
    assert doc.count(runs_copy) == len(commands) > 0, doc
    if f"python -m launcher.recipes.{source.stem}" in shipped:
        assert f"python {Path(directory) / (name + '.py')}" in doc


def copy_and_edit(tmp_path: Path, capsys) -> tuple[Path, str]:
    dest = tmp_path / "my recipes"  # a space: the printed command quotes it
    assert main(["cp", "linear", str(dest) + "/"]) == 0
    command = run_command_of(capsys.readouterr().out)
    edit_copy(dest / "linear.py")
    return dest, command


def test_copy_runs_from_its_directory_and_the_users_edit_takes_effect(tmp_path, capsys):
    dest, command = copy_and_edit(tmp_path, capsys)
    argv = [w for w in as_argv(command) if not w.startswith(("strategy=", "cluster"))]  # one device: quick
    run_dir = tmp_path / "run"
    proc = dlaunch(*argv, "trainer.steps=5", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert MARK in proc.stdout + proc.stderr
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["recipe"]["entry"] == str(dest / "linear.py") and config["recipe"]["name"] == "linear"
    assert summary(run_dir)["status"] == "completed" and summary(run_dir)["steps"] == 5


@pytest.mark.slow
def test_the_printed_command_runs_the_copy_in_every_worker(tmp_path, capsys):
    dest, command = copy_and_edit(tmp_path, capsys)
    run_dir = tmp_path / "run"
    # As printed: strategy=mirrored cluster=1x2, two worker processes, each importing the copy by its path.
    proc = dlaunch(*as_argv(command), "trainer.steps=5", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert MARK in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["recipe"]["entry"] == str(dest / "linear.py") and config["strategy"]["name"] == "mirrored"
    assert summary(run_dir)["status"] == "completed" and summary(run_dir)["num_replicas_in_sync"] == 2


def test_copy_runs_through_config_dir(tmp_path, capsys):
    dest = tmp_path / "mine"
    assert main(["cp", "linear", str(dest) + "/"]) == 0
    capsys.readouterr()
    edit_copy(dest / "linear.py")
    run_dir = tmp_path / "run"
    proc = dlaunch("--config-dir", str(dest), "recipe=linear", "trainer.steps=5", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert MARK in proc.stdout + proc.stderr
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["recipe"]["entry"] == str(dest / "linear.py")


def refusal(capsys) -> str:
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert err.startswith("dlaunch recipes cp: ") and err.count("\n") == 1, err  # one line
    return err


def test_cp_refuses_an_unknown_recipe(tmp_path, capsys):
    assert main(["cp", "lineer", str(tmp_path / "mine") + "/"]) == 2
    err = refusal(capsys)
    assert "unknown recipe 'lineer'" in err and "did you mean linear?" in err
    assert f"available: {', '.join(recipe_files())}" in err
    assert not (tmp_path / "mine").exists()


def test_cp_refuses_to_overwrite_unless_forced(tmp_path, capsys):
    dest = tmp_path / "mine"
    assert main(["cp", "linear", str(dest) + "/"]) == 0
    (dest / "linear.py").write_text("# my work\n")
    capsys.readouterr()
    assert main(["cp", "linear", str(dest)]) == 2
    err = refusal(capsys)
    assert str(dest / "linear.py") in err and "--force" in err
    assert (dest / "linear.py").read_text() == "# my work\n"
    (dest / "linear.py").unlink()  # one file left is refused too
    assert main(["cp", "linear", str(dest)]) == 2
    assert str(dest / "recipe" / "linear.yaml") in refusal(capsys)
    assert main(["cp", "linear", str(dest), "--force"]) == 0
    assert "# my work" not in (dest / "linear.py").read_text()
    assert_copied_module(dest / "linear.py", recipe_files()["linear"].with_suffix(".py"),
                         shlex.join(["dlaunch", "--config-dir", str(dest), "recipe=linear"]), str(dest))


def test_cp_refuses_a_destination_that_is_a_file(tmp_path, capsys):
    dest = tmp_path / "taken"
    dest.write_text("")
    assert main(["cp", "linear", str(dest) + "/"]) == 2
    assert "is not a directory" in refusal(capsys)


def test_cp_never_copies_a_recipe_over_itself(tmp_path, capsys, monkeypatch):
    package = tmp_path / "package"
    package.mkdir()
    for suffix in (".py", ".yaml"):
        (package / f"linear{suffix}").write_text(recipe_files()["linear"].with_suffix(suffix).read_text())
    monkeypatch.setattr(recipes_cp, "shipped", lambda: {"linear": package / "linear.yaml"})
    assert main(["cp", "linear", str(package), "--force"]) == 2
    assert "where dlaunch's own recipe linear lives" in refusal(capsys)
    assert (package / "linear.py").read_text() == recipe_files()["linear"].with_suffix(".py").read_text()


# ----- validate: a user's copy -----

def validate_edited(tmp_path: Path, capsys, old: str, new: str, *overrides: str) -> tuple[Path, str, str]:
    """A copy of linear with ``old`` replaced by ``new`` in its YAML, validated (exit 2); (its YAML, stdout, stderr)."""
    dest = tmp_path / "mine"
    assert main(["cp", "linear", str(dest) + "/"]) == 0
    config = dest / "recipe" / "linear.yaml"
    config.write_text(config.read_text().replace(old, new))
    capsys.readouterr()
    assert main(["validate", str(dest), "--cuda-devices", "0", *overrides]) == 2
    return config, *capsys.readouterr()


def test_validate_names_the_bad_key_of_a_broken_copy(tmp_path, capsys):
    config, out, err = validate_edited(tmp_path, capsys, "    lr: 0.05\n", "    lr: -1\n")
    lines = [line for line in out.splitlines() if line.startswith("  ")]  # every strategy has it: said once
    assert lines == [f"  FAIL  all {len(declared(config))} strategies ({', '.join(declared(config))}): "
                     "recipe.optimizer.lr = -1: Input should be greater than 0"], out  # the file: the line above
    assert "invalid configuration (1 problem)" in err and "recipe.optimizer.lr = -1" in err and "greater than 0" in err
    assert "Traceback" not in out + err


def test_validate_says_a_yaml_typo_once_and_a_strategys_own_problem_on_its_line(tmp_path, capsys):
    _, out, _ = validate_edited(tmp_path, capsys, "  noise: 0.1\n", "  nosie: 0.1\n", "input.global_batch_size=3")
    assert out.count("recipe.nosie") == 1 and "all 5 strategies" in out, out
    assert out.count("not divisible by 2") == 3 and "FAIL  one_device" not in out, out  # the 2-replica strategies


def test_validate_checks_the_copy_not_the_installed_recipe(tmp_path, capsys):
    """A field added to the copy's Config, set in its YAML: only the copied module accepts it."""
    dest = tmp_path / "mine"
    assert main(["cp", "linear", str(dest) + "/"]) == 0
    py, config = dest / "linear.py", dest / "recipe" / "linear.yaml"
    py.write_text(py.read_text().replace("class Config(RecipeConfig):\n", "class Config(RecipeConfig):\n    dropout: float = 0.0\n", 1))
    config.write_text(config.read_text().replace("  noise: 0.1\n", "  noise: 0.1\n  dropout: 0.5\n"))
    capsys.readouterr()
    assert main(["validate", str(config), "--cuda-devices", "0"]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert f"runs {py}" in " ".join(out.split())
    config.write_text(config.read_text().replace('  entry: "../linear.py"\n', ""))
    # As a run with --config-dir sees it: the copy replaces dlaunch's recipe linear, nothing is merged in.
    assert main(["validate", str(config), "--cuda-devices", "0"]) == 2
    out, err = capsys.readouterr()
    assert "FAIL" in out and "recipe.entry" in err and f"required key is missing in {config}" in err, out + err


def test_validate_explains_a_mistyped_override_and_checks_one_named_strategy(tmp_path, capsys):
    path = recipe_files()["linear"]
    assert main(["validate", str(path), "--cuda-devices", "0", "trainer.stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "trainer.stpes = 3" in err and "did you mean trainer.steps?" in err
    assert main(["validate", str(path), "strategy=mirrored", "--cuda-devices", "0"]) == 0
    out = capsys.readouterr().out
    assert "ok    mirrored cluster=1x2" in out and "one_device" not in out.split("\n", 1)[1]


def test_validate_refuses_what_is_no_recipe(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["validate", str(ROOT / "conf")]) == 2
    assert "no recipe YAML" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipe: [1\n")
    assert main(["validate", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert "cannot read this YAML" in err and "line 2" in err and "Traceback" not in out + err


def test_validate_reports_an_import_error_as_a_run_does(tmp_path, capsys):
    """The recipe's own code failing at import: exit 1 and the run's title, in validate as in a run."""
    dest = tmp_path / "mine"
    assert main(["cp", "linear", str(dest) + "/"]) == 0
    py = dest / "linear.py"
    py.write_text(py.read_text() + "import no_such_module_here\n")
    capsys.readouterr()
    assert main(["validate", str(dest), "--cuda-devices", "0"]) == 1
    out, err = capsys.readouterr()
    assert "the recipe's code failed (1 problem)" in err and "invalid configuration" not in err
    assert "no_such_module_here" in err and "Traceback" not in out + err
    config = dest / "recipe" / "linear.yaml"
    config.write_text(config.read_text().replace("    lr: 0.05\n", "    lr: -1\n"))
    py.write_text(py.read_text().replace("import no_such_module_here\n", ""))
    assert main(["validate", str(dest), "--cuda-devices", "0"]) == 2  # a config problem decides the exit code
    assert "invalid configuration" in capsys.readouterr().err


def test_a_run_names_a_mistyped_strategy_in_the_recipes_list(tmp_path, capsys):
    """A typo in the YAML's ``recipe.strategies`` is an error of the run too, not only of validate."""
    dest = tmp_path / "mine"
    assert main(["cp", "linear", str(dest) + "/"]) == 0
    config = dest / "recipe" / "linear.yaml"
    text = config.read_text()
    config.write_text(text.replace("strategies: [one_device, mirrored,", "strategies: [one_device, mirored,", 1))
    assert config.read_text() != text
    proc = dlaunch("--config-dir", str(dest), "recipe=linear", "launch.dry_run=true", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "recipe.strategies.1 = mirored" in proc.stderr and "did you mean mirrored?" in proc.stderr


def test_validate_without_a_path_asks_for_the_path_alone(capsys):
    assert main(["validate"]) == 2
    err = capsys.readouterr().err
    assert "the following argument is required: PATH" in err and "OVERRIDE" not in err.splitlines()[-1]
