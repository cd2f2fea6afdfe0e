"""``input.files`` and friends: globs resolved once in the parent, errors as one screen (exit 2)."""

from __future__ import annotations

import pytest
import yaml

from launcher.cli import job, run_record
from launcher.cli.main import main
from launcher.config import compose as composer
from launcher.config.errors import ConfigError
from launcher.input.files import write_file
from tests.conftest import dlaunch


def shards(directory, count, ext="jsonl"):
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        write_file(directory / f"train-{i}.{ext}", {"x": torch.zeros(2, 32), "y": torch.zeros(2, 1)})
    return directory


def problem(overrides):
    with pytest.raises(ConfigError) as info:
        composer.compose_and_validate(overrides, cuda_devices=0)
    (p,) = info.value.problems
    return p


def test_globs_become_the_same_ordered_absolute_list(tmp_path, monkeypatch):
    shards(tmp_path / "data", 3)
    monkeypatch.chdir(tmp_path)
    spec = composer.compose_and_validate(["input.files=data/train-*.jsonl"], cuda_devices=0)
    assert spec.input.files == [str(tmp_path / "data" / f"train-{i}.jsonl") for i in range(3)]
    assert spec.input.file_format == "jsonl" and spec.input_seed == 0
    again = type(spec).model_validate(spec.model_dump(mode="json"))  # what a worker does with job.json
    assert again.input.files == spec.input.files


def test_input_seed_defaults_to_the_trainer_seed():
    assert composer.compose_and_validate(["trainer.seed=5"], 0).input_seed == 5
    assert composer.compose_and_validate(["trainer.seed=5", "input.seed=9"], 0).input_seed == 9


def test_policy_names_are_case_insensitive(tmp_path):
    shards(tmp_path, 2)
    spec = composer.compose_and_validate([f"input.files={tmp_path}/*.jsonl", "input.auto_shard_policy=data"], 0)
    assert spec.input.auto_shard_policy == "DATA"


def test_no_match_names_input_files_and_the_pattern(tmp_path):
    p = problem([f"input.files={tmp_path}/nothing-*.jsonl"])
    assert p.key == "input.files" and "no file matches" in p.message and "nothing-*.jsonl" in p.message


def test_file_policy_with_too_few_files_shows_the_arithmetic(tmp_path):
    shards(tmp_path, 3)
    p = problem(["strategy=mirrored", "cluster=1x4", f"input.files={tmp_path}/*.jsonl", "input.auto_shard_policy=FILE"])
    assert p.key == "input.auto_shard_policy"
    assert "3 files for 4 workers" in p.message and "cluster 1x4 = 4 worker processes" in p.message
    assert "DATA" in p.message and "OFF" in p.message


def test_auto_with_too_few_files_is_fine(tmp_path):
    shards(tmp_path, 3)
    spec = composer.compose_and_validate(["strategy=mirrored", "cluster=1x4", f"input.files={tmp_path}/*.jsonl"], 0)
    assert spec.num_processes == 4


def test_file_policy_without_files():
    p = problem(["input.auto_shard_policy=FILE"])
    assert p.key == "input.auto_shard_policy" and "input.files is not set" in p.message


def test_unknown_extension_asks_for_a_format(tmp_path):
    (tmp_path / "a.txt").write_text("1\n")
    p = problem([f"input.files={tmp_path}/a.txt"])
    assert p.key == "input.format" and "jsonl, csv, pt, npy" in p.message


def test_bad_inputs_exit_2_with_one_screen(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(job, "cuda_devices", lambda: 0)  # the cases mean a machine without a GPU
    shards(tmp_path, 3)
    (tmp_path / "held").mkdir()
    for name in ("train.csv", "extra.pt", "notes.txt"):
        (tmp_path / "held" / name).write_text("x")
    cases = [
        ([f"input.files={tmp_path}/none-*.csv"], "input.files", "no file matches"),
        # a folder: the globs of what it holds (it suggested *.jsonl for a folder of csv and pt files)
        ([f"input.files={tmp_path}/held"], "input.files",
         f"is a directory; give the files in it, e.g. '{tmp_path}/held/*.csv' or '{tmp_path}/held/*.pt' (the files of"),
        (["input.format=parquet"], "input.format", "allowed: jsonl, csv, pt, npy"),
        (["input.auto_shard_policy=RANDOM"], "input.auto_shard_policy", "allowed: AUTO, FILE, DATA, OFF"),
        (["input.prefetch=-1"], "input.prefetch", "greater than or equal to 0"),
        (["strategy=mirrored", "cluster=1x4", f"input.files={tmp_path}/*.jsonl", "input.auto_shard_policy=FILE"],
         "input.auto_shard_policy", "3 files for 4 workers"),
    ]
    for overrides, key, text in cases:
        assert main(overrides) == 2, overrides
        err = capsys.readouterr().err
        assert key in err and text in err, err
        assert "Traceback" not in err and len(err.splitlines()) <= 25


def test_real_process_exit_code_for_a_glob_without_match(tmp_path):
    proc = dlaunch("input.files=data/train-*.jsonl", cwd=tmp_path)
    assert proc.returncode == 2
    assert "input.files" in proc.stdout + proc.stderr and "no file matches 'data/train-*.jsonl'" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr + proc.stdout
    assert not (tmp_path / "outputs").exists()


def test_a_dry_run_of_files_too_small_for_one_global_batch_is_a_config_error_with_the_numbers(tmp_path):
    """A dry run counts the files' rows: 6 rows and input.global_batch_size=8 exited 0 there, and the real run failed in
    its workers with NoBatch, which gave neither number."""
    shards(tmp_path / "data", 3)  # 2 rows each
    proc = dlaunch("input.files=data/train-*.jsonl", "input.global_batch_size=8", "launch.dry_run=true", cwd=tmp_path)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, out[-3000:]
    assert ("input.global_batch_size = 8 the 6 rows of the 3 input file(s) are fewer than one global batch "
            "(input.global_batch_size=8), and input.drop_remainder=true drops a partial batch") in out, out
    assert "use input.global_batch_size=6 or less, or input.drop_remainder=false" in out and "Traceback" not in out
    kept = dlaunch("input.files=data/train-*.jsonl", "input.global_batch_size=8", "input.drop_remainder=false",
                   "launch.dry_run=true", cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr[-3000:]


def test_the_saved_config_lists_the_resolved_files(tmp_path, monkeypatch):
    """A run's config.yaml (``run_record.as_run``; a dry run, which wrote it before, now writes nothing) lists the files."""
    shards(tmp_path / "data", 2)
    monkeypatch.chdir(tmp_path)
    spec = composer.compose_and_validate(["input.files=data/train-*.jsonl"], cuda_devices=0)
    saved = yaml.safe_load(run_record.as_run(spec))
    assert saved["input"]["files"] == [str(tmp_path / "data" / f"train-{i}.jsonl") for i in range(2)]
