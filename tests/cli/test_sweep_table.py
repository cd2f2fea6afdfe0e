"""A sweep's table names its best job, and its CSV has a column per swept key."""

from __future__ import annotations

import csv
import json

import pytest
from rich.console import Console

from launcher.cli import sweep, sweep_table
from tests.cli.report.runs import write_run


@pytest.fixture
def three_jobs(tmp_path, monkeypatch):
    """Three jobs over lr and seed; job 1 has the best eval_accuracy, job 2 the lowest eval_loss."""
    monkeypatch.setattr(sweep._ThisSweep, "before", {})
    for job, (lr, seed, acc, eval_loss) in enumerate([(0.1, 0, 0.91, 0.30), (0.01, 0, 0.97, 0.25), (0.01, 1, 0.95, 0.2)]):
        write_run(tmp_path / str(job), lr=lr, metrics={"eval_accuracy": acc, "eval_loss": eval_loss},
                  overrides=[f"recipe.optimizer.lr={lr}", f"+trainer.seed={seed}", "trainer.steps=200"])
    return tmp_path


def _shown(rows, where, direction=None) -> str:
    console = Console(record=True, width=200)
    sweep_table.show(rows, where, console, direction)
    return " ".join(console.export_text().split())


def test_the_table_names_the_job_with_the_best_first_metric_and_which_way_is_better(three_jobs):
    rows = sweep.collect(three_jobs)
    assert [r["metric"] for r in rows] == ["eval_accuracy"] * 3
    text = _shown(rows, three_jobs)
    assert "best: job 1 (recipe.optimizer.lr=0.01 +trainer.seed=0): eval_accuracy 0.97 (higher is better)" in text, text
    assert sweep_table.best(rows) == {"metric": "eval_accuracy", "lower_is_better": False, "value": 0.97, "jobs": [1]}


def test_an_optuna_direction_decides_a_metric_whose_name_does_not(three_jobs):
    rows = sweep.collect(three_jobs)
    for r in rows:  # a metric no name rule knows
        r["metric"] = "sparkle"
    assert sweep_table.best(rows) is None and "best:" not in _shown(rows, three_jobs)
    assert sweep_table.best(rows, "maximize")["jobs"] == [1]
    assert sweep_table.best(rows, "minimize")["jobs"] == [0]
    assert sweep_table.best(rows, "maximize", "sparkle")["jobs"] == [1]  # the study's objective is the ranked metric


def test_a_studys_direction_does_not_rank_a_metric_it_did_not_optimize(three_jobs):
    """A study minimizing the final loss (sweep.objective's default) while the table ranks the first metric the
    recipe's evaluate returned, eval_accuracy: the report starred the least accurate job."""
    rows = sweep.collect(three_jobs)
    assert sweep_table.best(rows, "minimize", "final_loss")["jobs"] == [1]  # eval_accuracy: higher is better


def test_ties_as_printed_are_named_together_and_a_sweep_of_equals_names_none(three_jobs):
    rows = sweep.collect(three_jobs)
    rows[2]["metric_value"] = 0.9700001  # printed as 0.97, as job 1's
    assert "best: jobs 1 (recipe.optimizer.lr=0.01 +trainer.seed=0), 2 (recipe.optimizer.lr=0.01 +trainer.seed=1), " \
           "tied: eval_accuracy 0.97" in _shown(rows, three_jobs)
    rows[0]["metric_value"] = 0.97
    assert sweep_table.best(rows) is None


def test_failed_jobs_and_jobs_ranked_by_other_metrics_are_not_best(three_jobs):
    rows = sweep.collect(three_jobs)
    rows[1]["status"] = "failed"
    assert sweep_table.best(rows)["jobs"] == [2]
    rows[2]["metric"] = "eval_loss"  # another recipe's first metric: the jobs do not rank against each other
    assert sweep_table.best(rows) is None


def test_the_csv_has_a_column_per_swept_key_and_the_json_each_jobs_params_and_the_best(three_jobs):
    rows = sweep.collect(three_jobs)
    sweep_table.write(three_jobs, rows)
    with open(three_jobs / "sweep_summary.csv") as f:
        reader = csv.DictReader(f)
        table = list(reader)
    assert reader.fieldnames[:4] == ["job", "recipe.optimizer.lr", "trainer.seed", "overrides"]  # steps: not swept
    assert [(r["recipe.optimizer.lr"], r["trainer.seed"]) for r in table] == [("0.1", "0"), ("0.01", "0"), ("0.01", "1")]
    summary = json.loads((three_jobs / "sweep_summary.json").read_text())
    assert summary["best"]["jobs"] == [1]
    assert summary["jobs"][2]["params"] == {"recipe.optimizer.lr": "0.01", "trainer.seed": "1", "trainer.steps": "200"}


def test_a_job_resumed_alone_keeps_the_columns_and_the_sweeps_direction(three_jobs):
    (three_jobs / "multirun.yaml").write_text("hydra: {}\n")
    rows = sweep.collect(three_jobs)
    sweep_table.write(three_jobs, rows, "minimize")  # an Optuna study that minimized eval_accuracy, as told
    assert json.loads((three_jobs / "sweep_summary.json").read_text())["best"]["jobs"] == [0]
    assert sweep.update_row(three_jobs / "2")
    summary = json.loads((three_jobs / "sweep_summary.json").read_text())
    assert summary["best"]["jobs"] == [0] and summary["jobs"][2]["params"]["trainer.seed"] == "1"
    assert summary["direction"] == "minimize"  # kept for the next such resume, also where no job was best
    with open(three_jobs / "sweep_summary.csv") as f:
        assert "trainer.seed" in next(csv.reader(f))


@pytest.mark.parametrize("typed, found", [
    (["a.b=1", "++c=x=y", "~d", "-- --epochs 2"], {"a.b": "1", "c": "x=y"}),
    (["recipe.name=linear"], {"recipe.name": "linear"}),
])
def test_params_are_the_key_value_overrides_by_key(typed, found):
    assert sweep_table.params(typed) == found


def test_a_sweep_record_without_hydras_overrides_is_left_alone(three_jobs, monkeypatch):
    """A recipe chosen by path earlier in the process (``user_recipes.TYPED`` set) and a ``multirun.yaml`` that holds
    no ``hydra.overrides``: collecting the sweep read ``record.hydra.overrides.task`` and raised ConfigAttributeError
    (seen in the full suite, where another test had chosen such a recipe first)."""
    from launcher.config import user_recipes

    monkeypatch.setitem(user_recipes.TYPED, "mine", "/somewhere/mine.py")
    (three_jobs / "multirun.yaml").write_text("hydra: {}\n")
    assert [r["job"] for r in sweep.collect(three_jobs)] == [0, 1, 2]
    assert (three_jobs / "multirun.yaml").read_text() == "hydra: {}\n"
