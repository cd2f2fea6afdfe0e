"""strategy=parameter_server's plan: the recipe's build() runs in the parent to place the variables on the ps tasks."""

from __future__ import annotations

from tests.conftest import FIXTURES, dlaunch

USES_THE_STRATEGY = """
from tests.fixtures.ps_eval_recipe import *  # noqa: F403
from tests.fixtures import ps_eval_recipe


def build(cfg, ctx):
    print("replicas", ctx.strategy.num_replicas_in_sync)  # ctx.strategy is None where build only learns the variables
    return ps_eval_recipe.build(cfg, ctx)
"""


def test_a_build_that_fails_in_the_plan_is_the_recipes_root_cause_not_a_traceback(tmp_path):
    """A recipe's build() that used ctx.strategy (None there) crashed the plan with Hydra's 40-line traceback."""
    (tmp_path / "uses_strategy.py").write_text(USES_THE_STRATEGY)
    proc = dlaunch("recipe.name=ps_eval", f"recipe.entry={tmp_path / 'uses_strategy.py'}",
                   "recipe.strategies=[parameter_server]", "strategy=parameter_server", "cluster.ps=1",
                   "launch.dry_run=true", cwd=tmp_path, env={"PYTHONPATH": str(FIXTURES.parent.parent)})
    screen = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1 and "Traceback" not in screen, screen[-3000:]
    assert ("its build() raised AttributeError: 'NoneType' object has no attribute 'num_replicas_in_sync' "
            f"({tmp_path / 'uses_strategy.py'}:") in screen, screen[-3000:]
    assert "there ctx.strategy is None" in screen
