"""Loading a recipe: what its own code does wrong is a RecipeError naming the file and line, never a traceback."""

from __future__ import annotations

import sys

import pytest

from launcher.runtime.recipe import RecipeError, import_entry, load


def recipe_file(tmp_path, text: str) -> str:
    path = tmp_path / "my_recipe.py"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,says", [
    ("x = 1\ndef f(:\n", "my_recipe.py:2: SyntaxError"),
    ("x = 1\nraise ValueError('no data')\n", "raised ValueError: no data at import"),
    ("import sys\nsys.exit(4)\n", "sys.exit(4)"),
    ("import nosuch_dependency_abc\n", "No module named 'nosuch_dependency_abc'"),
])
def test_import_errors_name_the_file_and_line(tmp_path, text, says):
    entry = recipe_file(tmp_path, text)
    with pytest.raises(RecipeError) as info:
        import_entry(entry)
    assert info.value.key == "recipe.entry" and says in info.value.message
    assert "dlaunch_recipe_my_recipe" not in sys.modules, "a recipe that failed to import is not left half-loaded"


def test_a_package_of_the_users_project_that_a_recipe_in_a_subfolder_imports_is_named_with_the_fix(tmp_path, monkeypatch):
    """cfg/tiny.py imports mymodels/ from where dlaunch was started: `No module named 'mymodels'`, and "fix it in the
    recipe's file", where the fix is the import path. The error now says where the package is and how it imports."""
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "__init__.py").write_text("")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "tiny.py").write_text("import mymodels.layers\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as info:
        import_entry(str(tmp_path / "cfg" / "tiny.py"))
    assert f"No module named 'mymodels' at import ({tmp_path}/cfg/tiny.py:1); mymodels is in {tmp_path}, where dlaunch " \
           f"was started, which is not on the import path (a recipe's own folder is): PYTHONPATH={tmp_path} dlaunch" \
           in info.value.message
    monkeypatch.syspath_prepend(str(tmp_path))  # importable: a missing module under it is a typo, not the path
    with pytest.raises(RecipeError) as info:
        import_entry(str(tmp_path / "cfg" / "tiny.py"))
    assert "No module named 'mymodels.layers'" in info.value.message and "PYTHONPATH" not in info.value.message
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)


def test_the_recipe_itself_missing_is_not_blamed_on_its_code():
    with pytest.raises(RecipeError) as info:
        import_entry("nosuch_recipe_module")
    assert "cannot import recipe module nosuch_recipe_module" in info.value.message


def test_signatures_are_checked_before_the_config(tmp_path):
    entry = recipe_file(tmp_path, "from launcher.recipes.linear import Config, train_step\ndef build(cfg):\n    pass\n")
    with pytest.raises(RecipeError) as info:
        load({"name": "r", "entry": entry, "not_a_field": 1})
    assert "build must take (cfg, ctx); it is build(cfg)" in info.value.message


def test_a_recipe_file_imports_its_sibling_modules_as_python_would(tmp_path, monkeypatch):
    """``from model_parts import make_net`` beside mine.py works as under ``python mine.py``; afterwards the folder
    is last on sys.path, so a later import of a sibling still works and no sibling shadows an installed package."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "sibling_parts_abc.py").write_text("WIDTH = 7\n")
    entry = recipe_file(tmp_path, "from sibling_parts_abc import WIDTH\n"
                                  "def later():\n    import sibling_later_abc\n    return sibling_later_abc.NAME\n")
    (tmp_path / "sibling_later_abc.py").write_text("NAME = 'later'\n")
    try:
        module = import_entry(entry)
        assert module.WIDTH == 7 and module.later() == "later"
        assert sys.path[-1] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1
    finally:
        for name in ("sibling_parts_abc", "sibling_later_abc", "dlaunch_recipe_my_recipe"):
            sys.modules.pop(name, None)


@pytest.mark.slow
def test_worker_processes_import_a_recipes_sibling_too(tmp_path):
    from pathlib import Path

    from tests.conftest import dlaunch, summary

    linear = (Path(__file__).resolve().parents[2] / "recipes" / "linear.py").read_text()
    (tmp_path / "net_parts.py").write_text("import torch\n\ndef make_net(features):\n    return torch.nn.Linear(features, 1)\n")
    mine = linear.replace("torch.nn.Linear(cfg.features, 1)", "make_net(cfg.features)")
    (tmp_path / "mine.py").write_text(mine.replace("\nimport torch\n", "\nimport torch\nfrom net_parts import make_net\n", 1))
    proc = dlaunch("recipe=mine.py", "strategy=multi_worker_mirrored", "cluster=1x2", "trainer.steps=5",
                   "hydra.run.dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(tmp_path / "run")["num_replicas_in_sync"] == 2


def test_auto_kernels_are_fused_adam_where_the_parameters_will_train_on_cuda():
    """In ``scope()`` parameters are built on the CPU and moved when it closes: the scope's device decides."""
    import torch

    from launcher.distribute.placement import Placement
    from launcher.runtime.recipe import OptimizerConfig

    params = list(torch.nn.Linear(3, 1).parameters())  # made outside: nothing is moved when the placement closes
    with Placement(torch.device("cuda", 0)):
        assert OptimizerConfig(name="adamw").kernels(params) == {"fused": True}
        assert OptimizerConfig(name="adam").kernels(params) == {"fused": True}
        assert OptimizerConfig(name="sgd").kernels(params) == {}  # torch's DTensor has no fused SGD: left to torch
        assert OptimizerConfig(name="adamw", implementation="foreach").kernels(params) == {"foreach": True}
    assert OptimizerConfig(name="adamw").kernels(params) == {}  # on the CPU: torch's own choice
    assert OptimizerConfig(name="adamw", implementation="for_loop").kernels(params) == {"foreach": False}


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_kernels_build_and_step_as_the_for_loop_does(name):
    import torch

    from launcher.runtime.recipe import OptimizerConfig

    def trained(implementation: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        optimizer = OptimizerConfig(name=name, lr=0.01, momentum=0.9 if name == "sgd" else 0.0,
                                    implementation=implementation).build(model.parameters())
        for _ in range(5):
            model(torch.ones(4, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert optimizer.defaults.get("fused") is (True if implementation == "fused" else None)
        return model.weight.detach()

    torch.testing.assert_close(trained("fused"), trained("for_loop"))


def test_a_recipe_file_runs_once_per_version_in_a_process(tmp_path):
    """Validation, the plan, config.yaml and a run in this process share one import of an unchanged file."""
    import os

    counter = tmp_path / "imports.txt"
    entry = recipe_file(tmp_path, f"open({str(counter)!r}, 'a').write('x')\n")
    try:
        first = import_entry(entry)
        assert import_entry(entry) is first and counter.read_text() == "x"
        stat = os.stat(entry)
        os.utime(entry, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # an edit: imported again
        assert import_entry(entry) is not first and counter.read_text() == "xx"
    finally:
        sys.modules.pop("dlaunch_recipe_my_recipe", None)


def test_the_optimizer_takes_betas_eps_and_parameter_groups():
    """What a converted training script sets on its AdamW (betas, eps, no weight decay on biases) is the recipe's too."""
    import torch

    from launcher.runtime.recipe import OptimizerConfig

    model = torch.nn.Linear(2, 1)
    groups = [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}]
    adamw = OptimizerConfig(name="adamw", weight_decay=0.1, betas=[0.9, 0.95], eps=1e-6).build(groups)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]["betas"] == (0.9, 0.95)
    assert adamw.param_groups[0]["eps"] == 1e-6 and [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0]
    assert OptimizerConfig(name="adagrad").build(model.parameters()).param_groups[0]["eps"] == 1e-10  # torch's own
    with pytest.raises(ValueError, match="at least 2 items"):
        OptimizerConfig(betas=[0.9])


def test_files_that_the_recipe_does_not_train_on_are_said_to_be_unused(run_dlaunch, tmp_path):
    """The plan lists input.files and their shards; a recipe whose build() ignores ctx.input_files trained on its
    own data without a word. linear reads them; digits does not."""
    import subprocess

    subprocess.run([sys.executable, "-m", "launcher.recipes.linear", str(tmp_path / "data"), "--shards", "2"],
                   check=True, capture_output=True)
    files = f"input.files={tmp_path / 'data'}/train-*.jsonl"
    proc, _ = run_dlaunch("recipe=digits", files, "trainer.steps=2", "cluster.device=cpu", name="digits")
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = " ".join(proc.stderr.split())
    assert ("input.files is set, but recipe digits's build() returned train_data of its own (TensorDataset), not "
            "ctx.input_files") in said
    proc, _ = run_dlaunch("recipe=linear", files, "trainer.steps=2", "cluster.device=cpu", name="linear")
    assert proc.returncode == 0 and "input.files is set" not in proc.stderr, proc.stderr[-2000:]
