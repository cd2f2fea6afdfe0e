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


def test_the_recipe_itself_missing_is_not_blamed_on_its_code():
    with pytest.raises(RecipeError) as info:
        import_entry("nosuch_recipe_module")
    assert "cannot import recipe module nosuch_recipe_module" in info.value.message


def test_signatures_are_checked_before_the_config(tmp_path):
    entry = recipe_file(tmp_path, "from launcher.recipes.linear import Config, train_step\ndef build(cfg):\n    pass\n")
    with pytest.raises(RecipeError) as info:
        load({"name": "r", "entry": entry, "not_a_field": 1})
    assert "build must take (cfg, ctx); it is build(cfg)" in info.value.message
