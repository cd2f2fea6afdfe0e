"""A job of dlaunch's command (launcher/cli/job.py): what one job leaves for the next one in the same process."""

from __future__ import annotations

from tests.conftest import dlaunch


COUNTING = """
import os

from launcher.recipes import linear
from launcher.recipes.linear import Config, evaluate, train_step  # noqa: F401

BUILDS = []  # module state: one job's builds, which the next job must not see


def build(cfg, ctx):
    BUILDS.append(1)
    with open(os.environ["BUILDS_FILE"], "a") as f:
        f.write(f"{len(BUILDS)} {os.getpid()}\\n")
    return linear.build(cfg, ctx)
"""


def test_each_job_run_in_dlaunchs_process_imports_its_recipe_afresh(tmp_path):
    """A one_device sweep runs its jobs one after another in dlaunch's process: a recipe's module-level state carried
    from job to job (a user's step counter made job 2 of `recipe.fail_at_step=-1,5` complete), where under mirrored
    each job's processes start afresh."""
    (tmp_path / "counting.py").write_text(COUNTING)
    builds = tmp_path / "builds.txt"
    proc = dlaunch("-m", "recipe=linear", f"recipe.entry={tmp_path / 'counting.py'}", "trainer.steps=3", "trainer.seed=0,1,2",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, env={"BUILDS_FILE": str(builds)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [line.split() for line in builds.read_text().splitlines()]
    assert [count for count, _ in seen] == ["1", "1", "1"], seen
    assert len({pid for _, pid in seen}) == 1  # one process ran all three


REGISTERING = """
import registry  # a module beside the recipe, imported once per process as Python keeps it

from launcher.recipes import linear
from launcher.recipes.linear import Config, build, evaluate, train_step  # noqa: F401

registry.register("my-model")  # may run once per process (a model type, a custom op)
"""


def test_a_recipe_whose_import_may_run_once_per_process_keeps_its_first_import(tmp_path):
    """Imported again for the next job, the recipe's registration raised ("already used"): that job is run with the
    module as the first job imported it, and says so, rather than failing."""
    (tmp_path / "registry.py").write_text(
        "NAMES = set()\n\n\ndef register(name):\n    if name in NAMES:\n        raise ValueError(f'{name} is already used')\n"
        "    NAMES.add(name)\n")
    (tmp_path / "registering.py").write_text(REGISTERING)
    proc = dlaunch("-m", "recipe=linear", f"recipe.entry={tmp_path / 'registering.py'}", "trainer.steps=3", "trainer.seed=0,1",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("ValueError: my-model is already used") == 1, proc.stderr[-3000:]
    assert "this job uses the module as an earlier job imported it" in proc.stderr
