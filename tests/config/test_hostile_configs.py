"""Hostile input: hundreds of generated bad configs are refused before anything starts, valid ones are not.

Every refusal exits 2 with one screen (at most 25 lines) that names the dotted key,
and no traceback; no run directory is made and Hydra never starts a job. The cases
come from ``tests/config/hostile.py``; the ids show how many there are.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

import pytest

from launcher.cli import job as cli_job
from launcher.cli import main as cli
from tests.conftest import dlaunch
from tests.config import hostile
from tests.config.hostile_files import write_inputs, write_recipes

INVALID = hostile.invalid_cases()
MAX_LINES = 25


def valid_cases() -> list[tuple[str, ...]]:
    """Configs that must pass: every strategy, shapes, cross-device ops, file formats and policies, task lists, hosts."""
    cases: list[tuple[str, ...]] = [("strategy=one_device",), ("strategy=one_device", "strategy.device=cpu:0")]
    shapes = (("1x1", 64), ("1x2", 64), ("1x3", 63), ("1x4", 64), ("2x1", 64), ("2x2", 64), ("3x2", 66))
    ops = ("null", "nccl_all_reduce", "hierarchical_copy", "reduction_to_one_device", "shared_memory")
    for i, strategy in enumerate(("mirrored", "multi_worker_mirrored")):
        cases += [(f"strategy={strategy}", f"cluster={shape}", f"input.global_batch_size={gbs}") for shape, gbs in shapes[i::2]]
        cases.append((f"strategy={strategy}", "cluster=2x2", "cluster.node_rank=1", "cluster.master_port=29500"))
        cases += [(f"strategy={strategy}", "cluster=1x2", f"strategy.cross_device_ops={op}") for op in ops]
    mirrored = ("strategy=mirrored", "cluster=1x2")
    for i, fmt in enumerate(("jsonl", "csv", "pt", "npy")):
        for policy in ("AUTO", "FILE", "DATA", "off")[i % 2 :: 2]:
            cases.append((*mirrored, f"input.files='@DATA@/valid/{fmt}/train-*.{fmt}'", f"input.auto_shard_policy={policy}"))
        cases.append((f"input.files='@DATA@/ok.{fmt}'", f"input.format={fmt}"))
    cases += [("input.files='@DATA@/legacy.pt'",), ("input.files=['@DATA@/ok.jsonl','@DATA@/valid/jsonl/*.jsonl']",),
              ("input.files='@DATA@/**/train-0.npy'",)]
    tasks = ("strategy=mirrored", "cluster=tasks")
    cases += [tasks, (*tasks, "cluster.task={type: chief, index: 0}"), (*tasks, "cluster.task={type: worker, index: 0}"),
              (*tasks, "cluster.tasks={chief: ['[::1]:29500'], worker: ['[::1]:29501']}"),
              (*tasks, "cluster.tasks={chief: ['node-0.cluster:29500'], worker: ['node-1.cluster:29500']}", "cluster.task={type: worker, index: 0}"),
              (*tasks, "cluster.devices_per_node=2", "input.global_batch_size=60",
               "cluster.tasks={chief: ['10.0.0.1:29500'], worker: ['10.0.0.2:1', '10.0.0.3:65535']}", "cluster.task={type: worker, index: 1}")]
    multi_node = ("strategy=mirrored", "cluster=2x1", "cluster.node_rank=1", "cluster.master_port=29500")
    for host in ("localhost", "::1", "10.0.0.1", "node-0.cluster.local", "my_host", "node0.example.com.", "2001:db8::1"):
        cases.append((*multi_node, f"cluster.master_addr='{host}'"))
    cases += [(f"recipe.entry=@RECIPES@/{name}",) for name in ("good.py", "good_manual.py", "good_defaults.py")]
    cases += [("recipe.entry=tests.fixtures.manual_recipe",)] + [(f"recipe.optimizer.name={n}",) for n in ("adam", "adamw")]
    cases += [("trainer.steps=1", "trainer.log_every=1", "input.prefetch=0", "input.seed=7", "launch.max_restarts=3",
               "launch.monitor_interval_s=10", "cluster.master_port=65535")]
    return cases


VALID = valid_cases()
COUNTS = collections.Counter(case.category for case in INVALID)
SUMMARY = f"{len(INVALID)} invalid ({', '.join(f'{k} {v}' for k, v in COUNTS.items())}), {len(VALID)} valid"


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hostile")
    return {"@RECIPES@": str(write_recipes(root / "recipes")), "@DATA@": str(write_inputs(root / "data"))}


def filled(overrides: tuple[str, ...], places: dict[str, str]) -> list[str]:
    out = []
    for text in overrides:
        for marker, path in places.items():
            text = text.replace(marker, path)
        out.append(text)
    return out


@pytest.fixture
def nothing_starts(monkeypatch, tmp_path):
    """An empty working directory, no CUDA, and a Hydra that fails the test if it is ever asked to run a job."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)

    def started(argv):
        raise AssertionError(f"a job was started: {argv}")

    monkeypatch.setattr(cli, "_hydra_main", started)
    return tmp_path


@pytest.mark.parametrize("summary", [SUMMARY])
def test_there_are_enough_cases_of_every_kind(summary):
    assert len(INVALID) >= 300 and len(VALID) >= 50, summary
    expected = {"wrong type", "out of range", "unknown key", "group option", "cluster shape", "indivisible batch",
                "address", "recipe", "input file", "screen", "run directory"}
    assert set(COUNTS) == expected, summary


@pytest.mark.parametrize("case", INVALID, ids=[case.id[:120] for case in INVALID])
def test_a_hostile_config_is_refused_before_anything_starts(case, places, nothing_starts, capsys):
    code = cli.main(filled(case.overrides, places))
    out, err = capsys.readouterr()
    screen = out + err
    user_code = case.category == "recipe" and any(o.endswith(tuple(f"/{n}" for n in hostile.RAISE_IN_USER_CODE)) for o in case.overrides)
    assert code == (1 if user_code else 2), screen
    assert ("the recipe's code failed" if user_code else "invalid configuration") in err
    assert case.key in screen and case.text in screen, screen
    assert "Traceback" not in screen and "\x1b" not in screen, screen
    assert len(screen.splitlines()) <= MAX_LINES, screen
    assert not any(nothing_starts.iterdir()), "a refused config must not create a run directory"


@pytest.mark.parametrize("overrides", VALID, ids=[" ".join(case)[:120] for case in VALID])
def test_a_valid_config_is_accepted(overrides, places, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)
    run_dir = tmp_path / "run"
    code = cli.main([*filled(overrides, places), "launch.dry_run=true", f"hydra.run.dir={run_dir}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "dry run: nothing is started" in out and not run_dir.exists()  # the job ran, and left nothing behind


def test_a_dry_run_that_cannot_count_a_file_names_it(places, monkeypatch, tmp_path, capsys):
    """A file that passes the cheap look but cannot be loaded: the dry run, which reads files whole, says which."""
    monkeypatch.chdir(tmp_path)
    code = cli.main([f"input.files={places['@DATA@']}/bad_pickle.pt", "launch.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "input.files" in err and "bad_pickle.pt cannot be read as" in err, err
    assert "Traceback" not in err and "dlaunch plan" not in err


SHELL_CASES = [("cluster.master_addr=0.0.0.0",), ("recipe.entry=@RECIPES@/no_build.py",), ("input.files='@DATA@/not_json.jsonl'",)]


def test_the_shell_sees_exit_code_2(places, tmp_path):
    """A few of them as real processes: the exit code a shell sees, and nothing made on disk."""
    def run(overrides):
        cwd = tmp_path / str(abs(hash(overrides)))
        cwd.mkdir()
        return dlaunch(*filled(overrides, places), cwd=cwd), cwd

    with ThreadPoolExecutor(len(SHELL_CASES)) as pool:
        results = list(pool.map(run, SHELL_CASES))
    for (proc, cwd), overrides in zip(results, SHELL_CASES):
        screen = proc.stdout + proc.stderr
        assert proc.returncode == 2, (overrides, screen)
        assert "Traceback" not in screen and len(screen.splitlines()) <= MAX_LINES, screen
        assert overrides[0].split("=")[0] in screen
        assert not any(cwd.iterdir())
