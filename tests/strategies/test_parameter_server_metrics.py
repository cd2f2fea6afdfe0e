"""strategy=parameter_server's logged metrics and evaluation, against one_device's on the same global batch.

Real chief, worker and ps processes; the recipe (``tests/fixtures/ps_eval_recipe.py``) returns a metric of its own
from its train_step, and its evaluate moves data to ``next(model.parameters()).device``.
"""

from __future__ import annotations

import pytest

from launcher.runtime.outputs import read_records
from tests.conftest import FIXTURES, summary

pytestmark = pytest.mark.slow
RECIPE = ("recipe.name=ps_eval", f"recipe.entry={FIXTURES / 'ps_eval_recipe.py'}",
          "recipe.strategies=[one_device,parameter_server]")
COMMON = ("input.global_batch_size=66", "trainer.steps=6", "trainer.log_every=1", "trainer.eval_every=3")


def _records(run_dir) -> tuple[list[dict], list[dict]]:
    """(the logged steps, the evaluations) of a run's metrics.jsonl."""
    records = read_records(run_dir / "metrics.jsonl")
    return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]


@pytest.mark.parametrize("workers", [2])  # one worker proves nothing two do not, at 120 s on a slow day
def test_sync_logs_the_global_batchs_loss_and_evaluates_real_values_as_one_device(run_dlaunch, workers):
    """Every logged loss (step 1 is before any update: logging, not training) and the recipe's own metric are the
    global batch's, as one device logs them; evaluate, mid-run and at the end, sees the model's values on the
    chief's device, and training goes on after it."""
    proc, one_dir = run_dlaunch(*RECIPE, *COMMON, name="one")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, ps_dir = run_dlaunch(*RECIPE, *COMMON, "strategy=parameter_server", "strategy.mode=sync",
                               f"cluster.workers={workers}", "cluster.ps=1", name="ps")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (one_steps, one_evals), (ps_steps, ps_evals) = _records(one_dir), _records(ps_dir)
    assert [r["step"] for r in ps_steps] == [r["step"] for r in one_steps] == [1, 2, 3, 4, 5, 6]
    for one, ps in zip(one_steps, ps_steps):
        for key in ("loss", "abs_err"):
            assert ps[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), (key, one, ps)
    assert [r["step"] for r in ps_evals] == [r["step"] for r in one_evals] == [3, 6]
    for one, ps in zip(one_evals, ps_evals):
        for key in ("eval_loss", "head_sum"):
            assert ps[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), (key, one, ps)
    assert summary(ps_dir)["final_loss"] == pytest.approx(summary(one_dir)["final_loss"], rel=1e-5)


def test_a_train_step_that_moves_data_to_the_parameters_device_is_told_why_it_is_meta(run_dlaunch):
    proc, run_dir = run_dlaunch(*RECIPE, "trainer.steps=2", "+recipe.data_to_params=true", "strategy=parameter_server",
                                "cluster.workers=1", "cluster.ps=1", name="ps")
    assert proc.returncode == 1
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "the model's input is on the meta device: under strategy=parameter_server a training task's module" in text
    assert "next(model.parameters()).device is meta in a train_step" in text
