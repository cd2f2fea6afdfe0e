"""The command line as a user meets it: --cfg job, the dry-run plan, the run directory contract."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import summary


@pytest.mark.parametrize("args", [("--cfg", "job", "strategy=mirrored", "cluster=1x2"),
                                  ("strategy=mirrored", "--cfg", "job", "cluster=1x2")], ids=["flags-first", "mixed"])
def test_cfg_job_prints_the_composed_config(run_dlaunch, args):
    """Flags anywhere among the overrides (Hydra's own parser reads overrides only after its last flag)."""
    proc, run_dir = run_dlaunch(*args)
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["strategy"]["name"] == "mirrored"
    assert printed["cluster"]["devices_per_node"] == 2
    assert not run_dir.exists()


def test_dry_run_prints_the_plan_and_starts_nothing(run_dlaunch):
    proc, run_dir = run_dlaunch("strategy=mirrored", "cluster=1x4", "launch.dry_run=true")
    assert proc.returncode == 0, proc.stderr
    plan = proc.stdout  # results on stdout
    for expected in ("dry run", "mirrored", "1x4", "4 in sync", "gloo", "global 64 = 4 replica(s) x 16 per replica", "127.0.0.1"):
        assert expected in plan, f"{expected!r} missing from the plan:\n{plan}"
    assert not run_dir.exists()  # nor its config.yaml, log or lock (tests/cli/test_dry_run.py)


def test_a_dry_run_in_a_finished_runs_directory_leaves_its_files_alone(run_dlaunch):
    """`dlaunch resume RUN launch.dry_run=true` (or hydra.run.dir=RUN) previews; it used to delete the run's results."""
    proc, run_dir = run_dlaunch("recipe=linear", "trainer.steps=10", "trainer.log_every=5")
    assert proc.returncode == 0, proc.stderr
    before = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "summary.json", ".hydra/overrides.yaml")}
    proc, _ = run_dlaunch("recipe=linear", "trainer.steps=20", "launch.dry_run=true")
    assert proc.returncode == 0 and "dry run" in proc.stdout, proc.stderr
    assert {name: (run_dir / name).read_bytes() for name in before} == before


def test_one_device_run_writes_the_output_contract(run_dlaunch):
    proc, run_dir = run_dlaunch("recipe=linear", "trainer.steps=30", "trainer.log_every=10")
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["trainer"]["steps"] == 30 and config["strategy"]["name"] == "one_device"
    # the recipe section as the recipe's Config read it: a default its YAML leaves out is recorded too
    assert config["recipe"]["optimizer"]["implementation"] == "auto" and config["recipe"]["noise"] == 0.1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 10, 20, 30, 30]  # the training records, then the end's evaluation
    assert all({"step", "loss", "examples_per_sec"} <= r.keys() for r in records[:-1])
    assert records[-1].keys() == {"step", "eval_loss"}
    s = summary(run_dir)
    for key in ("status", "strategy", "num_replicas_in_sync", "world_size", "global_batch_size", "steps", "first_loss",
                "final_loss", "examples_per_sec", "wall_seconds", "param_norm", "metrics"):
        assert key in s, key
    assert s["status"] == "completed" and s["steps"] == 30 and s["world_size"] == 1
    assert s["final_loss"] < s["first_loss"]
    assert isinstance(s["param_norm"], float) and s["param_norm"] > 0
    assert "eval_loss" in s["metrics"]
    # the first step (compile, warm-up) is timed on its own; it gives no ETA, the later logged steps do
    assert s["first_step_seconds"] > 0 and "first_step_seconds" in proc.stdout
    steps = [line for line in proc.stderr.splitlines() if line.startswith("INFO step ")]
    assert "eta" not in steps[0] and all("eta" in line for line in steps[1:]), steps
    assert str(run_dir) in proc.stdout  # the user is pointed at the results


def test_help_lists_the_config_groups(run_dlaunch):
    proc, _ = run_dlaunch("--help")
    assert proc.returncode == 0
    assert "strategy: central_storage, fsdp, mesh, mirrored, multi_worker_mirrored, one_device, parameter_server" in proc.stdout
    recipes = next(line for line in proc.stdout.splitlines() if line.startswith("recipe: "))
    assert {"linear", "wide_deep", "tp_mlp"} <= set(recipes[len("recipe: "):].split(", "))


def test_multirun_runs_each_job_in_its_own_directory(tmp_path):
    from tests.conftest import dlaunch

    sweep = tmp_path / "sweep"
    proc = dlaunch("-m", "strategy=one_device,mirrored", "cluster=1x1", "trainer.steps=5", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    strategies = sorted(summary(sweep / str(i))["strategy"] for i in (0, 1))
    assert strategies == ["mirrored", "one_device"]


def test_dry_run_shows_which_worker_reads_which_files(run_dlaunch, tmp_path):
    import subprocess
    import sys

    made = subprocess.run([sys.executable, "-m", "launcher.recipes.linear", "data", "--shards", "6"], cwd=tmp_path, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    proc, _ = run_dlaunch("strategy=mirrored", "cluster=1x4", "input.files=data/train-*.jsonl", "launch.dry_run=true")
    assert proc.returncode == 0, proc.stderr
    plan = proc.stdout  # results on stdout
    assert "auto_shard_policy AUTO -> FILE" in plan and "input shards (FILE, 8192 elements)" in plan
    rows = {line.split()[0]: line.split() for line in plan.splitlines() if line.strip()[:1].isdigit()}
    assert rows["0"][1:] == ["0", "train-00000-of-00006.jsonl,", "train-00004-of-00006.jsonl", "2730"]
    assert rows["3"][1:] == ["0", "train-00003-of-00006.jsonl", "1365"]
    assert "uneven shards: each epoch ends with the shortest worker, after 85 steps" in " ".join(plan.split())
    proc, _ = run_dlaunch("strategy=mirrored", "cluster=1x4", "input.files=data/train-*.jsonl", "input.auto_shard_policy=DATA", "launch.dry_run=true", name="data")
    assert "0-3" in proc.stdout + proc.stderr and "rank r keeps elements k%4==r" in proc.stdout + proc.stderr and "2048" in proc.stdout + proc.stderr


def test_a_bare_info_flag_after_an_override_prints_hydras_info(tmp_path):
    """Moved before the overrides, a bare --info (its value is optional) took the first override for its value."""
    from tests.conftest import dlaunch

    proc = dlaunch("trainer.steps=5", "--info", cwd=tmp_path, device=None)
    assert proc.returncode == 0 and "Config search path" in proc.stdout, proc.stderr[-2000:]
