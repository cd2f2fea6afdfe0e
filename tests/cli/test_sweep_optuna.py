"""Optuna sweeps: a failed trial ranks last and the study goes on, the study minimizes, its jobs resume one by one."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from tests.conftest import dlaunch


@pytest.mark.slow
def test_an_optuna_trial_that_fails_ranks_last_and_the_study_goes_on(tmp_path):
    """hydra-optuna-sweeper stopped the whole study with a traceback when a job's objective was NaN."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="hydra-optuna-sweeper is not installed")
    sweep = tmp_path / "study"
    proc = dlaunch("-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "recipe.optimizer.lr=choice(1e6,0.05)",
                   "trainer.steps=10", f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=400)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]  # a job failed; the study ended
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert sorted(j["status"] for j in jobs) == ["completed", "failed"]
    assert OmegaConf.load(sweep / "optimization_results.yaml").best_params["recipe.optimizer.lr"] == 0.05


@pytest.mark.slow
def test_an_optuna_study_minimizes_the_final_loss(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="hydra-optuna-sweeper is not installed")
    sweep = tmp_path / "study"
    proc = dlaunch("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.sampler.seed=1",
                   "recipe.optimizer.lr=interval(0.001,0.1)", "trainer.steps=20", f"hydra.sweep.dir={sweep}", cwd=tmp_path,
                   timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = OmegaConf.load(sweep / "optimization_results.yaml")
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert len(jobs) == 4 and all(j["status"] == "completed" for j in jobs)
    assert best.best_value == pytest.approx(min(j["final_loss"] for j in jobs))
    assert 0.001 <= best.best_params["recipe.optimizer.lr"] <= 0.1


@pytest.mark.slow
def test_an_optuna_sweeps_jobs_are_resumed_one_by_one_and_their_rows_updated(tmp_path):
    """Optuna's sweeper writes no multirun.yaml: the sweep's line named `dlaunch resume SWEEP_DIR`, which then said it
    was no run or sweep directory, and a job resumed alone left its row in sweep_summary.json as it was."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="hydra-optuna-sweeper is not installed")
    from tests.conftest import PROBE

    sweep = tmp_path / "study"
    proc = dlaunch("-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "recipe.fail_step=5,100",
                   f"recipe.entry={PROBE}", "recipe.fail_replica=0", "trainer.steps=8", "trainer.checkpoint.every_steps=2",
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=400)
    assert proc.returncode == 1, proc.stderr[-3000:]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    failed = next(j["job"] for j in jobs if j["status"] == "failed")
    last = proc.stdout.rstrip().splitlines()[-1] if proc.stdout.strip() else ""
    said = " ".join((proc.stdout + proc.stderr).split())
    assert f"go on with each job: dlaunch resume {sweep / str(failed)} (the sweeper's study is not replayed" in said, last
    whole = dlaunch("resume", str(sweep), cwd=tmp_path)
    assert whole.returncode == 2 and "Traceback" not in whole.stderr, whole.stderr[-3000:]
    assert "a sweep of an optimizing sweeper (Optuna)" in whole.stderr and f"dlaunch resume {sweep / str(failed)}" in whole.stderr
    again = dlaunch("resume", str(sweep / str(failed)), "recipe.fail_replica=-1", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = {j["job"]: j for j in json.loads((sweep / "sweep_summary.json").read_text())["jobs"]}
    assert (rows[failed]["status"], rows[failed]["resumed_from_step"]) == ("completed", 4)
