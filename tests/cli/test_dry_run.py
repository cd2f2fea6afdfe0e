"""A dry run leaves nothing behind: no run directory (nor its parents, nor a checkpoint directory) after it."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from launcher.cli.dry_run import LeaveNothing
from tests.conftest import dlaunch


def test_a_dry_run_leaves_no_run_directory(tmp_path):
    """The default run directory (outputs/DATE/TIME, which Hydra makes with its dlaunch.log before the job runs) goes
    again; before, it stayed with config.yaml, dlaunch.log and .dlaunch.lock, and a checkpoint directory was made."""
    proc = dlaunch("strategy=mirrored", "cluster=1x2", "trainer.checkpoint.every_steps=5",
                   f"trainer.checkpoint.dir={tmp_path / 'checkpoints'}", "launch.dry_run=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dry run: nothing is started" in proc.stdout and str(tmp_path / "outputs") in proc.stdout
    assert not list(tmp_path.iterdir())


def _config(run_dir, dry_run=True):
    return OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}, "job": {"name": "dlaunch"}}, "launch": {"dry_run": dry_run}})


def _run(callback, config, *files):
    """What Hydra does around a job: the callback's start, the run directory with ``files``, the callback's end."""
    callback.on_run_start(config)
    run_dir = Path(config.hydra.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in files:
        (run_dir / name).write_text("")
    callback.on_run_end(config)


def test_a_directory_that_was_there_before_stays(tmp_path):
    (tmp_path / "run").mkdir()
    _run(LeaveNothing(), _config(tmp_path / "run"), "dlaunch.log")
    assert (tmp_path / "run").is_dir()


def test_a_new_directory_in_which_anything_else_turned_up_stays_whole(tmp_path):
    """Another command's run started in the same second, in the same directory: its files are not the dry run's."""
    _run(LeaveNothing(), _config(tmp_path / "a" / "run"), "dlaunch.log", "summary.json")
    assert sorted(p.name for p in (tmp_path / "a" / "run").iterdir()) == ["dlaunch.log", "summary.json"]


def test_new_parents_go_too_but_not_one_that_holds_something_else(tmp_path):
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "earlier").mkdir()
    _run(LeaveNothing(), _config(tmp_path / "outputs" / "day" / "time"), "dlaunch.log")
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["earlier"]


def test_a_run_that_is_not_a_dry_run_keeps_its_directory(tmp_path):
    _run(LeaveNothing(), _config(tmp_path / "run", dry_run=False), "dlaunch.log")
    assert (tmp_path / "run" / "dlaunch.log").is_file()


def test_a_dry_run_sweep_keeps_its_directory_where_a_job_recorded_something(tmp_path):
    """A refused job's row (SWEEP_DIR/.dlaunch/refused-N.json) and the sweep's table say why it would not start."""
    sweep = tmp_path / "sweep"
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}, "job": {"name": "dlaunch"}}, "launch": {"dry_run": True}})
    callback = LeaveNothing()
    callback.on_multirun_start(config)
    for job in ("0", "1", ".dlaunch"):
        (sweep / job).mkdir(parents=True)
    for name in ("multirun.yaml", "0/dlaunch.log", "1/dlaunch.log", ".dlaunch/refused-1.json"):
        (sweep / name).write_text("")
    callback.on_multirun_end(config)
    assert sorted(p.name for p in sweep.iterdir()) == [".dlaunch", "0", "1", "multirun.yaml"]
    (sweep / ".dlaunch" / "refused-1.json").unlink()
    (sweep / ".dlaunch").rmdir()
    callback.on_multirun_end(config)
    assert not sweep.exists()


def test_a_dry_run_resume_of_a_completed_sweep_leaves_its_record_as_it_was(tmp_path):
    """Each completed job marked itself a job of this command (its record's time), so the sweep's multirun.yaml was
    not put back: it recorded launch.dry_run=true, and every later `dlaunch resume SWEEP_DIR` would have been a dry run."""
    sweep = tmp_path / "sweep"
    ran = dlaunch("-m", "trainer.steps=3", "trainer.seed=0,1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    kept = {name: (sweep / name).read_bytes() for name in ("multirun.yaml", "sweep_summary.json", "sweep_summary.csv")}
    jobs = {d.name: (d / ".hydra" / "overrides.yaml").stat().st_mtime_ns for d in sweep.iterdir() if d.name.isdigit()}
    dry = dlaunch("resume", str(sweep), "launch.dry_run=true", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert {name: (sweep / name).read_bytes() for name in kept} == kept
    assert {d: (sweep / d / ".hydra" / "overrides.yaml").stat().st_mtime_ns for d in jobs} == jobs
    assert "launch.dry_run" not in (sweep / "multirun.yaml").read_text()


def test_a_tf_config_in_the_environment_is_said_not_to_be_read_with_the_overrides_that_run_its_cluster(tmp_path):
    import json

    tf = {"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 1}}
    proc = dlaunch("launch.dry_run=true", cwd=tmp_path, env={"TF_CONFIG": json.dumps(tf)})
    said = ("dlaunch: TF_CONFIG is set in this environment, but dlaunch's cluster is its config's, in every process "
            "(TF_CONFIG is not read); its cluster as dlaunch's: cluster=tasks 'cluster.tasks={worker: [\"localhost:12345\", "
            "\"localhost:23456\"]}' 'cluster.task={type: worker, index: 1}'")
    assert proc.returncode == 0 and said in proc.stderr, proc.stderr
    assert "cluster        1x1" in proc.stdout
    # what it says to type runs that cluster (a shell would take the quotes off)
    overrides = ["cluster=tasks", "cluster.tasks={worker: [\"localhost:12345\", \"localhost:23456\"]}",
                 "cluster.task={type: worker, index: 1}", "strategy=multi_worker_mirrored"]
    proc = dlaunch("launch.dry_run=true", *overrides, cwd=tmp_path, env={"TF_CONFIG": json.dumps(tf)})
    assert proc.returncode == 0 and "TF_CONFIG" not in proc.stderr, proc.stderr
    assert "cluster        2x1" in proc.stdout and "this machine is node 1 of 2" in proc.stdout, proc.stdout
