"""The linear recipe: on files whose rows do not fit recipe.features, through the command line."""

from __future__ import annotations

import pytest

from launcher.recipes import linear

pytestmark = pytest.mark.slow


def test_files_wider_than_recipe_features_stop_the_run_with_the_file_and_the_key(run_dlaunch, tmp_path):
    files = linear.write_files(tmp_path / "data", shards=2)  # x holds 32 numbers per row
    proc, _ = run_dlaunch("recipe=linear", "recipe.features=16", f"input.files={tmp_path}/data/train-*.jsonl",
                          "trainer.steps=2")
    assert proc.returncode != 0
    assert (f"{files[0]}: field 'x' holds 32 number(s) per row, but the model is built for recipe.features=16: "
            "set recipe.features=32") in proc.stderr
    assert "mat1 and mat2" not in proc.stderr
