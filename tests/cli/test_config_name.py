"""``--config-name`` runs the user's primary config; ``--config-path`` is refused; bad recipe input exits 2 or 1."""

from __future__ import annotations

from tests.conftest import dlaunch, summary

MYRUN = """\
# dlaunch --config-dir cfg --config-name myrun
defaults:
  - config            # dlaunch's defaults
  - override recipe: digits
  - _self_
trainer:
  steps: 4
"""


def test_config_name_runs_the_users_primary_config(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "myrun.yaml").write_text(MYRUN)
    run_dir = tmp_path / "run"
    proc = dlaunch("--config-dir", "cfg", "--config-name", "myrun", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(run_dir)["steps"] == 4 and "digits" in (run_dir / "config.yaml").read_text()


def test_config_path_and_a_missing_config_name_are_refused(tmp_path):
    proc = dlaunch("--config-path", "cfg", cwd=tmp_path)
    assert proc.returncode == 2 and "--config-path" in proc.stdout + proc.stderr and "--config-dir" in proc.stdout + proc.stderr
    proc = dlaunch("--config-name", "nope", cwd=tmp_path)
    assert proc.returncode == 2 and "no such primary config" in proc.stdout + proc.stderr and "nope.yaml" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_bad_recipe_input_exits_2_or_1_naming_the_file(tmp_path):
    proc = dlaunch("recipe=missing/mine.py", cwd=tmp_path)
    assert proc.returncode == 2 and str(tmp_path / "missing" / "mine.py") in proc.stdout + proc.stderr
    (tmp_path / "broken.py").write_text("raise ValueError('bad import')\n")
    proc = dlaunch("recipe=broken.py", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "the recipe's code failed" in proc.stdout + proc.stderr and f"{tmp_path / 'broken.py'}:1" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "Fix it where it points (the recipe's file, or a module it imports)" in proc.stderr and "--cfg job" not in proc.stderr  # no config advice
