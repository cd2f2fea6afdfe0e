"""sweep.objective: what an optimizing sweeper gets from each job, and what is said when no job reports it."""

from __future__ import annotations

import logging
import math

from launcher.cli.sweep import objective
from tests.conftest import dlaunch


def test_the_objective_is_the_final_loss_or_a_named_metric_and_the_worst_for_a_failed_job(caplog):
    done = {"status": "completed", "final_loss": 0.5, "metrics": {"eval_accuracy": 0.97}}
    assert objective(done, "final_loss") == 0.5
    assert objective(done, "eval_accuracy", "maximize") == 0.97
    assert objective({"status": "failed", "final_loss": 3.0}, "final_loss") == math.inf
    assert objective(None, "eval_accuracy", "maximize") == -math.inf
    with caplog.at_level(logging.ERROR, logger="dlaunch"):
        assert objective(done, "eval_acuracy", "maximize") == -math.inf  # a metric the recipe does not report
    assert ("sweep.objective=eval_acuracy: the job reported no such metric (it has final_loss, eval_accuracy; did you "
            "mean eval_accuracy?)") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dlaunch"):  # Optuna's default direction, against the metric's name
        assert objective(done, "eval_accuracy", "minimize") == objective(done, "eval_accuracy", "minimize") == 0.97
        assert objective(done, "final_loss", "minimize") == 0.5
    assert caplog.text.count("sweep.objective=eval_accuracy: higher is better by its name, but the study's direction is "
                             "minimize (hydra.sweeper.direction, Optuna's default: minimize), so it looks for the lowest "
                             "value; hydra.sweeper.direction=maximize looks for the best") == 1, caplog.text


def test_an_objective_no_job_reported_is_said_with_what_they_report(tmp_path):
    """A typo in sweep.objective gave a column of dashes and exit 0, and nothing said why nothing was ranked."""
    proc = dlaunch("-m", "recipe.optimizer.lr=0.1,0.01", "trainer.steps=4", "sweep.objective=eval_los",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("sweep.objective=eval_los: no job reported such a metric (they report final_loss, eval_loss; did you mean "
            "eval_loss?), so nothing ranks the jobs") in " ".join((proc.stdout + proc.stderr).split()), proc.stderr[-3000:]
