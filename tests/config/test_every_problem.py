"""One screen names every problem, and no follow-on problem that a fault elsewhere caused (a config audit's cases).

In-process through ``launcher.cli.main.main``; the problems are read from stderr.
"""

from __future__ import annotations

import re

import pytest

from launcher.cli import job as cli_job
from launcher.cli.main import main
from launcher.config import compose as composer


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)  # the cases mean a machine without a GPU
    dirs, name = list(composer.CONFIG_DIRS), composer.CONFIG_NAME
    yield
    composer.CONFIG_DIRS[:], composer.CONFIG_NAME = dirs, name  # main() sets them for --config-dir, --config-name


def problems(capsys, *overrides: str) -> tuple[int, str]:
    """The count the title gives and the whole of stderr."""
    assert main([*overrides, "cluster.device=cpu", "launch.dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    found = re.search(r"invalid configuration \((\d+) problems?\)", err)
    assert found, err
    return int(found.group(1)), err


def test_a_trainer_rule_does_not_hide_the_run_rules(capsys):
    """A profile window longer than the run stopped the batch's rule; so did a warm-up longer than the run (the
    profile's default window refused too once its key was dropped)."""
    n, err = problems(capsys, "strategy=mirrored", "cluster=1x3", "input.global_batch_size=32", "trainer.steps=10",
                      "trainer.profile.enabled=true", "trainer.lr_schedule.warmup_steps=50", "cluster.backend=nccl",
                      "input.auto_shard_policy=FILE")
    assert n == 5, err
    for key in ("trainer.lr_schedule.warmup_steps = 50", "trainer.profile.wait = 10", "input.global_batch_size = 32",
                "input.auto_shard_policy = FILE", "cluster.backend = nccl"):
        assert key in err, err
    n, err = problems(capsys, "strategy=mirrored", "cluster=1x3", "input.global_batch_size=32", "trainer.seed=abc",
                      "trainer.steps=10", "trainer.lr_schedule.warmup_steps=50")
    assert n == 3 and "not divisible by 3" in err, err


def test_every_schedule_setting_that_would_do_nothing_is_named(capsys):
    n, err = problems(capsys, "trainer.lr_schedule.decay_steps=5", "trainer.lr_schedule.min_lr_ratio=0.1",
                      "trainer.lr_schedule.warmup_start=0.5")
    assert n == 3 and "warmup_start needs warmup_steps > 0" in err, err


def test_a_rule_about_the_recipes_code_is_named_beside_other_problems(capsys, tmp_path):
    """eval_every with a recipe without evaluate was named only once everything else was right."""
    recipe = tmp_path / "noeval.py"
    recipe.write_text("from launcher.recipes.linear import Config, build, train_step  # noqa: F401\n")
    n, err = problems(capsys, f"recipe={recipe}", "trainer.eval_every=5", "trainer.seed=-1", "recipe.noise=-1")
    assert n == 3 and "trainer.eval_every = 5" in err and "has no evaluate" in err, err


def test_a_value_hydras_own_config_refuses_does_not_hide_the_rest(capsys):
    n, err = problems(capsys, "hydra.job.chdir=maybe", "input.global_batch_size=-2")
    assert n == 2 and "hydra.job.chdir = maybe" in err and "not a valid bool" in err, err
    assert "input.global_batch_size = -2" in err and "Error merging override" not in err


def test_each_input_file_at_fault_is_named(capsys, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "empty.jsonl").write_text("")
    (data / "bad.jsonl").write_text("[1]\n")
    (data / "ok.jsonl").write_text('{"x": 1}\n')
    n, err = problems(capsys, f"input.files=[{data}/nope*.csv,{data}]")
    assert n == 2 and "no file matches" in err and "is a directory" in err, err
    n, err = problems(capsys, f"input.files=[{data}/empty.jsonl,{data}/bad.jsonl,{data}/ok.jsonl]")
    assert n == 2 and "empty.jsonl is empty" in err and "bad.jsonl is not a valid jsonl file" in err, err


def test_no_follow_on_problem_from_a_value_at_fault(capsys):
    """The batch judged by a replica count the strategy refuses, accumulation by a batch that does not split, and a
    parameter-server rule judging the default cluster of a task list at fault: each was a second, false problem."""
    n, err = problems(capsys, "recipe=tp_mlp", "strategy=mesh", "cluster=1x4",
                      "strategy.device_assignment.computation_shape=[1,2]", "strategy.device_assignment.num_replicas=3")
    assert n == 1 and "strategy.device_assignment.num_replicas = 3" in err, err
    n, err = problems(capsys, "strategy=mirrored", "cluster=1x3", "input.global_batch_size=32", "trainer.grad_accum_steps=4")
    assert n == 1 and "not divisible by 3" in err, err
    n, err = problems(capsys, "strategy=mirrored", "cluster=1x2", "input.global_batch_size=7", "trainer.grad_accum_steps=3")
    assert n == 1 and "global batch 32" not in err, err  # accumulation judged against the default batch (a review)
    n, err = problems(capsys, "strategy=mirrored", "cluster=2x1", "cluster.master_addr=192.0.2.123", "cluster.node_rank=7")
    assert n == 1 and "not an address of this machine" not in err, err  # as if no node rank had been given
    n, err = problems(capsys, "recipe=wide_deep", "strategy=parameter_server", "cluster=tasks",
                      "cluster.tasks={chief: ['127.0.0.1:2000'], ps: ['bad host:1']}", "cluster.task={type: chief, index: 0}")
    assert n == 1 and "cluster.ps" not in err, err


def test_a_task_given_key_by_key(capsys):
    """CONFIG.md lists cluster.task.type and cluster.task.index; the option's task is null, so Hydra knew neither."""
    assert main(["strategy=mirrored", "cluster=tasks", "cluster.device=cpu", "cluster.task.type=worker",
                 "launch.dry_run=true"]) == 0
    assert "this machine is node 1 of 2" in capsys.readouterr().out


def test_a_master_addr_that_is_not_this_machines_is_refused_when_every_node_runs_here(capsys):
    """Was an OSError traceback from the emulated rendezvous, with a half-made run directory."""
    for shape in (["strategy=multi_worker_mirrored", "cluster=2x1"], ["recipe=wide_deep", "strategy=parameter_server", "cluster.ps=1"]):
        n, err = problems(capsys, *shape, "cluster.master_addr=192.0.2.123")
        assert n == 1 and "cluster.master_addr = 192.0.2.123" in err and "not an address of this machine" in err, err
    n, err = problems(capsys, "strategy=multi_worker_mirrored", "cluster=2x1", "cluster.master_addr=nohost.invalid")
    assert "does not resolve" in err, err


def test_values_are_shown_as_given(capsys):
    """Rich turned :b: into an emoji: a:b:c showed as a🅱c."""
    n, err = problems(capsys, "trainer.resume=/nope/:fire:/ck", "input.global_batch_size=0")
    assert ":fire:" in err and "\U0001f525" not in err, err


def test_a_yaml_that_does_not_parse_is_named_with_its_line(capsys, tmp_path):
    """A user's primary config or group option with a YAML syntax error: was a traceback (exit 1), or 'unknown
    strategy' for a file that is there."""
    (tmp_path / "myrun.yaml").write_text("defaults:\n  - config\n  - _self_\ntrainer:\n  steps: [5\n")
    assert main(["--config-dir", str(tmp_path), "--config-name", "myrun", "launch.dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'myrun.yaml'}\n    cannot read this YAML: expected ',' or ']'" in err and "Traceback" not in err, err
    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "broken.yaml").write_text("name: mirrored\nbucket_cap_mb: [1\n")
    assert main(["--config-dir", str(tmp_path), "strategy=broken", "launch.dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert "broken.yaml\n    cannot read this YAML" in err, err


def test_a_strategy_preset_of_ones_own_runs(capsys, tmp_path):
    """A --config-dir's DIR/strategy/NAME.yaml, as the --config-dir error text advertises, was 'unknown strategy'."""
    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "big_buckets.yaml").write_text("name: mirrored\nbucket_cap_mb: 100\n")
    assert main(["--config-dir", str(tmp_path), "strategy=big_buckets", "cluster.device=cpu", "launch.dry_run=true"]) == 0
    assert "100 MB buckets" in capsys.readouterr().out


@pytest.mark.parametrize("argv,meant", [(["reprot", "runs/x"], "dlaunch report runs/x"), (["recipe", "ls"], "dlaunch recipes ls"),
                                        (["train"], None)])
def test_a_misspelled_command_is_named(argv, meant, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"unknown command {argv[0]!r}" in err and "The commands are recipes, report, resume" in err, err
    assert (f"did you mean `{meant}`?" in err) if meant else "did you mean" not in err


def test_a_number_of_the_wrong_type_says_what_it_takes(capsys):
    n, err = problems(capsys, "trainer.steps=null")
    assert "Input should be a valid integer greater than 0" in err, err


def test_a_defaults_entry_not_found_names_the_file_and_the_configs_there(capsys, tmp_path):
    """`- confg` in a primary config said only `confg = confg: config not found`."""
    (tmp_path / "myrun.yaml").write_text("defaults:\n  - confg\n  - _self_\n")
    assert main(["--config-dir", str(tmp_path), "--config-name", "myrun", "launch.dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert "defaults of myrun.yaml = confg" in err and "did you mean config?" in err, err


def test_resume_of_a_file_names_its_run_directory(capsys, tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    assert main(["resume", str(tmp_path / "summary.json")]) == 2
    err = capsys.readouterr().err
    assert f"a file, not a run directory; did you mean {tmp_path}?" in err, err


def test_a_script_not_there_and_a_recipe_beside_it_hide_no_other_problem(capsys, tmp_path, monkeypatch):
    """A script-mode review: with a recipe beside the script only the recipe was named; with a script not there, the
    trainer keys a script is refused were not (the rules ran as if no script were given)."""
    monkeypatch.chdir(tmp_path)
    given = ("script=missing.py", "strategy=mirrored", "cluster=1x2", "trainer.steps=5", "trainer.grad_accum_steps=2",
             "launch.max_restarts=-1")
    n, err = problems(capsys, *given)
    assert n == 4, err
    assert "no such file: " in err and "trainer.steps = 5" in err and "trainer.grad_accum_steps = 2" in err
    assert "launch.max_restarts = -1" in err
    n, err = problems(capsys, *given, "recipe=linear")
    assert n == 5 and "recipe = linear" in err and "a script takes the recipe's place" in err, err
