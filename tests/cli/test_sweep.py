"""Sweeps: a job that fails is reported and the sweep goes on; the summary table and files; Optuna; joblib."""

from __future__ import annotations

import csv
import json

import pytest
from omegaconf import OmegaConf

from tests.conftest import dlaunch


@pytest.mark.slow
def test_a_four_job_sweep_with_a_failing_job_goes_on_and_summarizes(tmp_path):
    sweep = tmp_path / "sweep"
    proc = dlaunch("-m", "strategy=mirrored", "cluster=1x2", "recipe.optimizer.lr=0.05,0.02,0.01,1e6", "trainer.steps=30",
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=400)
    assert proc.returncode == 1, proc.stderr[-3000:]  # the sweep ran to the end, and says a job failed
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "completed", "completed", "failed"]
    assert "recipe.optimizer.lr=1000000.0" in jobs[3]["overrides"] and "loss is" in jobs[3]["error"]
    assert all(j["final_loss"] is not None and j["metric"] == "eval_loss" for j in jobs[:3])
    with open(sweep / "sweep_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == [j["status"] for j in jobs] and rows[0]["examples_per_sec"]
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "sweep summary: 4 jobs, 1 failed" in text and "recipe.optimizer.lr=0.02" in text
    ports = {json.loads((sweep / str(i) / "summary.json").read_text())["world_size"] for i in range(3)}
    assert ports == {2}  # every job ran its own 2-process group


@pytest.mark.slow
def test_joblib_runs_two_multi_process_jobs_at_once_without_port_clashes(tmp_path):
    sweep = tmp_path / "parallel"
    proc = dlaunch("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "strategy=mirrored", "cluster=1x2",
                   "recipe.optimizer.lr=0.05,0.01", "trainer.steps=30", f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "completed"]
    # the two jobs' lines interleave on one terminal: each says whose it is, rank 0's in the workers too
    for job in (0, 1):
        assert f"[job {job}] INFO MirroredStrategy: 2 replica(s) in sync" in proc.stderr, proc.stderr[-3000:]
        assert f"[job {job}] INFO step 30/30" in proc.stderr, proc.stderr[-3000:]
    assert "[job" not in (sweep / "0" / "dlaunch.log").read_text()  # the job's own log file needs no tag


def test_an_invalid_combination_is_a_failed_job_and_the_others_run(tmp_path):
    from tests.conftest import dlaunch

    sweep_dir = tmp_path / "sweep"
    proc = dlaunch("-m", "strategy=one_device,mirrored", "cluster=1x1,1x2", "trainer.steps=5", f"hydra.sweep.dir={sweep_dir}",
                   cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    jobs = json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "config error", "completed", "completed"]
    assert "cluster 1x2 has 2 devices" in jobs[1]["error"]
    # said before job 0 ran, not only when job 1's turn came: the user may stop the sweep and fix it now
    told = " ".join(proc.stderr.split())
    announced = told[told.index("these sweep jobs will not start"):told.index("OneDeviceStrategy")]  # before job 0 trains
    assert "(each is reported as a failed job in its turn; the other jobs run, Ctrl-C stops the sweep)" in announced
    assert "cluster=1x2 strategy=one_device: cluster=1x2: strategy one_device runs 1 replica" in announced
    assert "trainer.steps=5" not in announced  # what every job shares does not tell the job apart
    assert "every job: trainer.steps=5" in proc.stdout
    assert proc.stdout.count("dlaunch plan") == 1  # the plan once per sweep
    assert not [line for line in proc.stdout.splitlines() if line != line.rstrip()]


def test_a_job_whose_recipe_raises_at_import_is_a_failed_job_not_a_config_error(tmp_path):
    from tests.conftest import dlaunch

    (tmp_path / "broken.py").write_text("import json\nraise RuntimeError('the user broke it')\n")
    sweep_dir = tmp_path / "sweep"
    proc = dlaunch("-m", f"recipe.entry=launcher.recipes.linear,{tmp_path / 'broken.py'}", "trainer.steps=5",
                   f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    jobs = json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "failed"]  # the user's code failed (exit 1), not the config
    assert "broken.py:2" in jobs[1]["error"] and "the user broke it" in jobs[1]["error"]


def test_a_job_that_failed_after_a_save_is_resumed_by_the_sweeps_one_command(tmp_path):
    """A failed job printed its own `dlaunch resume JOB_DIR`, in the middle of the sweep's output; the sweep's last
    line named no way on. Now the job names its checkpoint, and the sweep ends with one command that resumes it."""
    from tests.conftest import PROBE

    sweep = tmp_path / "sweep"
    common = [f"recipe.entry={PROBE}", "trainer.steps=8", "trainer.checkpoint.every_steps=2", f"hydra.sweep.dir={sweep}"]
    # job 0 fails at step 5; job 1's step 100 never comes (each job counts its steps afresh)
    proc = dlaunch("-m", "recipe.fail_replica=0", "recipe.fail_step=5,100", *common, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "dlaunch resume " + str(sweep / "0") not in out
    assert f"newest checkpoint: {sweep / '0' / 'checkpoints' / 'step-00000004'} (the sweep's last line says" in out
    assert out.rstrip().splitlines()[-1].startswith(
        f"failed jobs saved checkpoints (job 0 at step 4); once the cause is fixed, go on with: dlaunch resume {sweep} ")
    assert json.loads((sweep / "0" / "summary.json").read_text())["checkpoint_step"] == 4
    again = dlaunch("resume", str(sweep), "recipe.fail_replica=-1", cwd=tmp_path)  # the cause, fixed
    assert again.returncode == 0, again.stderr[-3000:]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [(j["status"], j["resumed_from_step"]) for j in jobs] == [("completed", 4), ("completed", None)]
    assert "failed jobs saved" not in again.stdout + again.stderr


def test_a_failed_jobs_loss_is_the_last_it_logged_with_its_step_not_a_final_loss(tmp_path):
    """Job 0 fails at step 5, having logged its loss at step 1 only (every 10 steps): the table, the JSON and the
    report showed that step-1 loss as its final loss."""
    from tests.conftest import PROBE

    sweep = tmp_path / "sweep"
    proc = dlaunch("-m", f"recipe.entry={PROBE}", "recipe.fail_replica=0", "recipe.fail_step=5,100", "trainer.steps=8",
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path)  # job 1's step 100 never comes
    assert proc.returncode == 1, proc.stderr[-3000:]
    (logged,) = [json.loads(line) for line in (sweep / "0" / "metrics.jsonl").read_text().splitlines()]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [(j["status"], j["final_loss"] is None, j["last_logged_loss"], j["last_logged_step"]) for j in jobs] == [
        ("failed", True, logged["loss"], 1), ("completed", False, None, None)]
    row = next(line for line in proc.stdout.splitlines() if " failed " in line)
    shown = f"last logged {logged['loss']:.6g} (step 1)"
    assert shown in row, row
    assert dlaunch("report", str(sweep), cwd=tmp_path, device=None).returncode == 0
    assert shown in (sweep / "report.html").read_text()


@pytest.mark.slow
def test_a_signal_stops_the_sweep_its_job_saves_and_the_rest_do_not_start(tmp_path):
    """Ctrl-C in a sweep ends the sweep, not only the job it reached: that job saves and stops, the later jobs are
    not started, and the summary, the table and ``dlaunch report`` say so."""
    import signal
    import subprocess

    from tests.conftest import PROBE, command
    from tests.launch.test_restarts import STARTUP_S, finish, logged_steps, wait_for

    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(command("-m", f"recipe.entry={PROBE}", "+recipe.step_sleep=0.05", "trainer.steps=100000",
                                    "trainer.log_every=1", "trainer.checkpoint.every_steps=100000", "trainer.seed=1,2,3",
                                    f"hydra.sweep.dir={sweep}"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: max(logged_steps(sweep / "0"), default=0) >= 3, STARTUP_S, "job 0 to train")
        proc.send_signal(signal.SIGINT)
    finally:
        out = finish(proc, timeout=60)
    assert proc.returncode == 130, out[-3000:]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["stopped", "not started", "not started"], out[-3000:]
    assert jobs[1]["error"] == "job 0 was stopped by SIGINT, which stopped the sweep"
    text = " ".join(out.split())
    assert "sweep summary: 3 jobs, 1 stopped, 2 not started" in text
    assert f"checkpoint {sweep / '0' / 'checkpoints'}" in text and text.count("dlaunch resume") == 1  # the sweep's, below
    assert logged_steps(sweep / "1") == [] and not (sweep / "1" / "checkpoints").exists()
    report = dlaunch("report", str(sweep), cwd=tmp_path)
    assert report.returncode == 0, report.stderr  # the stopped job's partial curve is worth a page
    page = (sweep / "report.html").read_text()
    assert "Jobs a signal cut short (1 stopped, 2 not started)" in page and "stopped by SIGINT; checkpoint at step" in page
    assert f"<code>dlaunch resume {sweep}</code> resumes each stopped job" in page
    assert "Failed jobs" not in page
    assert f"the sweep was stopped; go on with: dlaunch resume {sweep}" in text
    again = dlaunch("resume", str(sweep), "trainer.steps=40", cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed"] * 3
    assert "resumed from" in again.stderr and logged_steps(sweep / "2") == list(range(1, 41))


def test_a_dry_run_sweep_shows_each_plan_and_no_failed_jobs(tmp_path):
    """A preview runs no job: no sweep table of jobs 'failed' for want of a summary, exit 0, and no sweep directory
    left behind (nor a Hydra record, a config.yaml or a log in it)."""
    proc = dlaunch("-m", "trainer.seed=1,2", "launch.dry_run=true", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "job 1 in" in proc.stdout and "failed" not in proc.stdout + proc.stderr
    assert not (tmp_path / "sweep").exists()


def test_a_dry_run_sweep_with_refused_jobs_counts_them_and_leaves_nothing(tmp_path):
    """Its table listed the refused jobs alone, as '2 jobs, 2 failed', their own override taken for every job's, and
    the sweep directory stayed with a summary and a log in each job's directory."""
    proc = dlaunch("-m", "recipe.optimizer.lr=0.1,0.01", "trainer.grad_accum_steps=1,3", "launch.dry_run=true",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.count("does not split into 3 equal micro-batches") == 2, proc.stderr[-3000:]
    assert ("dry run: the sweep's plans are above; 2 of its jobs are refused (the reasons above); nothing is started"
            in proc.stdout + proc.stderr), proc.stderr[-3000:]
    assert "sweep summary" not in proc.stdout + proc.stderr and "every job:" not in proc.stdout
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_the_summary_lists_this_sweeps_jobs_only_whatever_their_directories_are_named(tmp_path):
    """An earlier sweep's job directories in the same sweep dir are not this sweep's; hydra.sweep.subdir may name
    the jobs; an override whose value holds a space stays one override."""
    sweep, small = tmp_path / "sweep", ("recipe.examples=64", "trainer.steps=3")
    first = dlaunch("-m", *small, "input.global_batch_size=8,16,32", f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    again = dlaunch("-m", *small, "input.global_batch_size=4,8", f"hydra.sweep.dir={sweep}", "trainer.checkpoint.dir='/tmp/a b'",
                    "hydra.sweep.subdir=gbs${input.global_batch_size}", cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [(j["job"], j["dir"].rsplit("/", 1)[1]) for j in jobs] == [(0, "gbs4"), (1, "gbs8")]
    assert "every job:" in again.stdout and "trainer.checkpoint.dir='/tmp/a b'" in again.stdout
    assert "b'" not in again.stdout.split("sweep summary")[1].replace("'/tmp/a b'", "")


def test_a_sweep_whose_jobs_share_one_checkpoint_directory_is_refused_and_hydras_own_keys_tell_them_apart(tmp_path, capsys):
    """Job 1 resumed from job 0's last checkpoint and "completed" with its weights, nothing trained. A directory
    per job through Hydra's own config (${hydra:job.num}) runs: it resolves in each job, not in the pre-check."""
    from launcher.cli.main import main

    common = ["-m", "cluster.device=cpu", "trainer.steps=2", "trainer.checkpoint.every_steps=2", "recipe.optimizer.lr=0.05,0.02"]
    shared = tmp_path / "ck"
    assert main([*common, f"trainer.checkpoint.dir={shared}", f"hydra.sweep.dir={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err
    assert "trainer.checkpoint.dir = " in err and "2 jobs of this sweep would save into" in err, err
    assert not (tmp_path / "a").exists() and not shared.exists()
    ranged = [*common[:-1], "trainer.seed=range(0,2)"]  # jobs the pre-check does not list: the sweeper's
    assert main([*ranged, f"trainer.checkpoint.dir={shared}", f"hydra.sweep.dir={tmp_path / 'a'}"]) == 2
    assert "the jobs of this sweep would save into" in capsys.readouterr().err
    own = str(tmp_path / "ck") + "${hydra:job.num}"
    assert main([*common, f"trainer.checkpoint.dir={own}", f"hydra.sweep.dir={tmp_path / 'b'}"]) == 0
    assert (tmp_path / "ck0" / "step-00000002").is_dir() and (tmp_path / "ck1" / "step-00000002").is_dir()
    run = tmp_path / "run"  # and a single run's ${hydra:runtime.output_dir}
    assert main(["cluster.device=cpu", "trainer.steps=2", "trainer.checkpoint.every_steps=2", f"hydra.run.dir={run}",
                 "trainer.checkpoint.dir=${hydra:runtime.output_dir}/own"]) == 0
    assert (run / "own" / "step-00000002").is_dir()


@pytest.mark.parametrize("objective, charted", [("final_loss", "eval_loss"), ("eval_accuracy", "eval_accuracy")])
def test_the_table_shows_the_objective_else_the_first_metric_evaluate_returned(tmp_path, monkeypatch, objective, charted):
    from launcher.cli import sweep
    from tests.cli.report.runs import write_run

    monkeypatch.setattr(sweep._ThisSweep, "before", {})
    write_run(tmp_path / "0", lr=0.05, metrics={"eval_loss": 0.42, "eval_accuracy": 0.93}, objective=objective)
    row = sweep.collect(tmp_path)[0]
    assert (row["metric"], row["metric_value"]) == (charted, {"eval_loss": 0.42, "eval_accuracy": 0.93}[charted])


def test_a_resumed_sweeps_table_shows_the_jobs_own_overrides_and_labels_a_resumed_jobs_throughput(tmp_path, monkeypatch):
    """``dlaunch resume SWEEP`` adds trainer.resume=auto to the jobs it runs (not to a completed one it keeps): the table
    showed it in those rows alone. A resumed job's examples/s and wall time are its last command's, and say so."""
    from rich.console import Console

    from launcher.cli import sweep, sweep_table

    monkeypatch.setattr(sweep._ThisSweep, "before", {})
    for job, extra, summary in ((0, [], {}), (1, ["trainer.resume=auto"], {"resumed_from_step": 15})):
        (tmp_path / str(job) / ".hydra").mkdir(parents=True)
        OmegaConf.save(OmegaConf.create([f"trainer.seed={job}", "trainer.steps=30", *extra]),
                       tmp_path / str(job) / ".hydra" / "overrides.yaml")
        (tmp_path / str(job) / "summary.json").write_text(json.dumps(
            {"status": "completed", "final_loss": 0.5, "examples_per_sec": 1000.0, "wall_seconds": 2.0, **summary}))
    rows = sweep.collect(tmp_path)
    assert [r["overrides"] for r in rows] == ["trainer.seed=0 trainer.steps=30", "trainer.seed=1 trainer.steps=30"]
    assert [r["resumed_from_step"] for r in rows] == [None, 15]
    console = Console(record=True, width=200)
    sweep_table.show(rows, tmp_path, console)
    text = console.export_text()
    assert "trainer.resume" not in text and "every job: trainer.steps=30" in text
    assert "1000*" in text and "2.00*" in text and text.count("*") == 3, text
    assert "* resumed (job 1 from step 15): examples/s and wall s cover only the steps" in " ".join(text.split())
    sweep_table.write(tmp_path, rows)
    with open(tmp_path / "sweep_summary.csv") as f:
        assert [r["resumed_from_step"] for r in csv.DictReader(f)] == ["", "15"]


@pytest.mark.slow
def test_a_sweep_and_its_report_rank_by_sweep_objective(tmp_path):
    """The recipe's evaluate returns eval_mse, eval_loss, eval_accuracy: neither its first metric nor the
    alphabetical first is what the table shows and the report charts, but sweep.objective's."""
    from tests.conftest import FIXTURES

    sweep = tmp_path / "obj"
    proc = dlaunch("-m", "recipe=linear", f"recipe.entry={FIXTURES / 'three_metrics_recipe.py'}",
                   "recipe.optimizer.lr=0.01,0.003", "trainer.steps=10", "sweep.objective=eval_loss",
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [j["metric"] for j in jobs] == ["eval_loss", "eval_loss"]
    assert list(json.loads((sweep / "0" / "summary.json").read_text())["metrics"]) == ["eval_mse", "eval_loss", "eval_accuracy"]
    shown = dlaunch("report", str(sweep), cwd=tmp_path, device=None)
    assert shown.returncode == 0, shown.stderr
    assert "Charted metric: <b>eval_loss</b>" in (sweep / "report.html").read_text()


def test_hydras_line_for_each_job_shows_a_user_recipe_as_typed(tmp_path):
    """dlaunch stores a recipe chosen by path as the option user/NAME; Hydra's `#0 : ...` line showed that name."""
    from launcher.cli import recipes

    assert recipes.main(["cp", "linear", str(tmp_path / "mine") + "/"]) == 0
    proc = dlaunch("-m", "recipe=mine/recipe/linear.yaml", "trainer.steps=2,3", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert f"#0 : recipe={tmp_path / 'mine' / 'recipe' / 'linear.yaml'} trainer.steps=2" in out, out[-3000:]
    assert "user/linear" not in out


def test_a_sweep_whose_job_a_signal_stopped_elsewhere_exits_as_stopped_not_failed(tmp_path):
    """A job run by joblib or SLURM that a signal stopped (scancel, a preempted node) reached dlaunch only through its
    directory: the sweep exited 1, as for a failure; it exits as the job did, 128 + N."""
    from launcher.cli import sweep

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    sweep.SweepSummary().on_multirun_start(config)
    job = tmp_path / "0"
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(["trainer.seed=1"]), job / ".hydra" / "overrides.yaml")
    (job / "config.yaml").write_text("{}\n")
    (job / "summary.json").write_text(json.dumps({"status": "stopped", "stopped_by": "SIGTERM", "exit_code": 143}))
    sweep.SweepSummary().on_multirun_end(config)
    assert (sweep.failed_jobs(), sweep.stopped_code()) == (0, 143)


@pytest.mark.slow
def test_a_stop_after_a_jobs_run_completed_still_stops_the_sweep(tmp_path):
    """A lone run that a stop reaches after it completed exits 0 (test_restarts); a sweep's job must still stop the
    sweep: its row says completed, the later jobs are not started, and dlaunch exits 128+N."""
    import signal
    import subprocess

    from tests.conftest import PROBE, command
    from tests.launch.test_restarts import STARTUP_S, finish, wait_for

    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(command("-m", f"recipe.entry={PROBE}", "strategy=mirrored", "cluster=1x2", "cluster.device=cpu",
                                    "trainer.steps=6", "+recipe.linger=30", "trainer.seed=1,2", f"hydra.sweep.dir={sweep}"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (sweep / "0" / "all-completed").exists(), STARTUP_S, "job 0 to complete")
        proc.send_signal(signal.SIGTERM)
    finally:
        out = finish(proc, timeout=120)
    assert proc.returncode == 143, out[-3000:]
    jobs = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "not started"], out[-3000:]
    assert "the run completed, nothing was cut short" not in out, out[-3000:]  # no exit-0 line for a sweep's job


def test_the_summarys_dir_is_each_jobs_absolute_directory_however_the_sweep_was_given_or_resumed(tmp_path):
    """``dir`` in sweep_summary.csv was the job's directory as hydra.sweep.dir was given (``sweep/0``) for a job that
    ran, absolute for a config error, and absolute for every job after ``dlaunch resume``. Now it is always absolute."""
    sweep = tmp_path / "sweep"

    def dirs() -> list[str]:
        with open(sweep / "sweep_summary.csv") as f:
            return [r["dir"] for r in csv.DictReader(f)]

    absolute = [str((sweep / str(n)).resolve()) for n in range(2)]
    proc = dlaunch("-m", "strategy=one_device", "cluster=1x1,1x2", "trainer.steps=3", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]  # job 1 is a config error: one_device on 2 devices
    assert dirs() == absolute
    assert json.loads((sweep / "sweep_summary.json").read_text())["sweep_dir"] == str(sweep.resolve())
    again = dlaunch("resume", "sweep", cwd=tmp_path)
    assert again.returncode == 1, again.stderr[-3000:]
    assert dirs() == absolute
