"""``pip install .`` (not editable) ships the configs and recipes: dlaunch runs from anywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


# setuptools copies into build/ and never deletes there: a wheel built in a checkout whose build/ outlived a
# removed module ships that module. The wheel is built from a copy of the sources alone.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "outputs", "multirun", "*.egg-info",
                                     "__pycache__", ".pytest_cache")


def _can_build_wheels() -> bool:
    """The build runs without isolation (no registry needed): setuptools >= 70.1 builds wheels itself,
    older ones need the ``wheel`` package. A bare venv of Python 3.11 (or the GPU machine) may have neither."""
    import importlib.util

    return importlib.util.find_spec("setuptools.command.bdist_wheel") is not None or importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if not _can_build_wheels():
        pytest.skip("this interpreter cannot build a wheel without a registry (setuptools < 70.1 and no wheel package)")
    out, sources = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("sources") / "dlaunch"
    shutil.copytree(ROOT, sources, ignore=NOT_SOURCES)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(sources)],
        check=True, capture_output=True, text=True,
    )
    (path,) = out.glob("dlaunch-*.whl")
    return path


def test_the_wheel_ships_the_modules_of_the_tree_and_no_others(wheel):
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("launcher/") and n.endswith(".py")}
    tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "launcher").rglob("*.py") if "__pycache__" not in p.parts}
    tree |= {f"launcher/recipes/{p.name}" for p in (ROOT / "recipes").glob("*.py")}  # recipes/ ships as launcher.recipes
    tree |= {f"launcher/conf/{p.name}" for p in (ROOT / "conf").glob("*.py")}  # and conf/ as launcher.conf
    assert shipped == tree, (sorted(tree - shipped), sorted(shipped - tree))


def test_every_config_group_directory_is_a_listed_package():
    """A directory of YAML under conf/ that pyproject does not list: setuptools warns at every install, 40 lines."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    groups = {"launcher.conf." + ".".join(d.relative_to(ROOT / "conf").parts) for d in (ROOT / "conf").rglob("*")
              if d.is_dir() and "__pycache__" not in d.parts}
    assert groups <= listed, sorted(groups - listed)


def test_wheel_carries_configs_and_recipes(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("launcher/conf/config.yaml", "launcher/conf/strategy/mirrored.yaml",
                   "launcher/conf/hydra/job_logging/dlaunch.yaml", "launcher/recipes/linear.py",
                   "launcher/recipes/linear.yaml", "launcher/cli/main.py"):
        assert needed in names, needed


def test_installed_copy_runs_from_another_directory(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import sys, launcher.cli.main as m; print(m.__file__); sys.exit(m.main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "recipe=linear", "cluster.device=cpu", "trainer.steps=5", f"hydra.run.dir={elsewhere / 'run'}"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(str(site)), "the installed copy, not the checkout, must run"
    assert (elsewhere / "run" / "summary.json").exists()
