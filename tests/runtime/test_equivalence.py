"""The same recipe, seed and global batch give the same model under one_device, mirrored and central_storage."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import FIXTURES, PROBE, summary

pytestmark = pytest.mark.slow
COMMON = ("recipe=linear", "trainer.steps=40", "trainer.log_every=10")


def final_params(run_dlaunch, name, *args, entry=PROBE):
    proc, run_dir = run_dlaunch(*COMMON, f"recipe.entry={entry}", "+recipe.save_params=true", *args, name=name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(run_dir / "params.pt", weights_only=True), summary(run_dir)


def assert_same_model(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


TWO_REPLICAS = {  # args, worker processes
    "mirrored_1x2": (("strategy=mirrored", "cluster=1x2"), 2),
    "central_storage_2_threads": (("strategy=central_storage", "strategy.compute_devices=[cpu:0,cpu:1]"), 1),
}


@pytest.mark.parametrize("two", list(TWO_REPLICAS))
def test_one_device_and_two_replicas_agree(run_dlaunch, two):
    args, processes = TWO_REPLICAS[two]
    one, s1 = final_params(run_dlaunch, "one", "strategy=one_device")
    other, s2 = final_params(run_dlaunch, "two", *args)
    assert_same_model(one, other)
    assert (s1["num_replicas_in_sync"], s2["num_replicas_in_sync"], s2["world_size"]) == (1, 2, processes)
    assert s2["final_loss"] == pytest.approx(s1["final_loss"], rel=1e-4)
    assert s2["param_norm"] == pytest.approx(s1["param_norm"], rel=1e-5)


def test_manual_mode_step_runs_unchanged_under_both(run_dlaunch, tmp_path):
    manual = FIXTURES / "manual_recipe.py"
    probe = tmp_path / "manual_probe.py"  # the manual step with the probe's parameter dump
    probe.write_text(
        f"import runpy\n_m = runpy.run_path({str(manual)!r})\n_p = runpy.run_path({str(PROBE)!r})\n"
        "Config = _p['Config']\nbuild = _p['build']\nevaluate = _p['evaluate']\ntrain_step = _m['train_step']\n"
    )
    one, _ = final_params(run_dlaunch, "m1", "strategy=one_device", entry=probe)
    two, _ = final_params(run_dlaunch, "m2", "strategy=mirrored", "cluster=1x2", entry=probe)
    assert_same_model(one, two)


def test_every_cross_device_op_trains_the_same_model(tmp_path):
    from tests.conftest import dlaunch

    sweep = tmp_path / "sweep"
    ops = ("null", "nccl_all_reduce", "hierarchical_copy", "reduction_to_one_device")
    proc = dlaunch("-m", "recipe=linear", "strategy=mirrored", "cluster=1x2", "trainer.steps=20",
                   f"strategy.cross_device_ops={','.join(ops)}", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [summary(sweep / str(i)) for i in range(len(ops))]
    assert all(r["status"] == "completed" and r["world_size"] == 2 for r in runs), runs
    chosen = [OmegaConf.load(sweep / str(i) / "config.yaml").strategy.cross_device_ops for i in range(len(ops))]
    assert chosen == [None, *ops[1:]]
    for r in runs[1:]:
        assert r["param_norm"] == pytest.approx(runs[0]["param_norm"], rel=1e-6)
        assert r["final_loss"] == pytest.approx(runs[0]["final_loss"], rel=1e-6)


def test_file_backed_runs_agree_under_data_and_off_sharding(run_dlaunch, tmp_path):
    """DATA and OFF keep one device's global batches (the same seeded shuffle everywhere), so the models agree."""
    from launcher.recipes import linear

    linear.write_files(tmp_path / "data", shards=4, fmt="npy", seed=5)  # not the set the recipe generates at seed 0
    files = "input.files=data/train-*.npy"
    one, s1 = final_params(run_dlaunch, "f1", "strategy=one_device", files)
    for policy in ("DATA", "OFF"):
        two, s2 = final_params(run_dlaunch, f"f2-{policy}", "strategy=mirrored", "cluster=1x2", files, f"input.auto_shard_policy={policy}")
        assert_same_model(one, two)
        assert s2["param_norm"] == pytest.approx(s1["param_norm"], rel=1e-5)
    generated, _ = final_params(run_dlaunch, "gen", "strategy=one_device")
    assert not torch.allclose(generated["weight"], one["weight"])  # the files, not the generated set, were read
    assert s1["final_loss"] < s1["first_loss"] / 5


def test_file_sharding_trains_on_every_file(run_dlaunch, tmp_path):
    """FILE gives each worker its own files (not one device's batches), and still fits the same data."""
    from launcher.recipes import linear

    linear.write_files(tmp_path / "data", shards=4, fmt="jsonl")
    _, s = final_params(run_dlaunch, "file", "strategy=mirrored", "cluster=1x2", "input.files=data/train-*.jsonl", "input.auto_shard_policy=FILE")
    assert s["final_loss"] < s["first_loss"] / 5 and s["steps"] == 40


@pytest.mark.parametrize("two", ["fsdp_1x2", "central_storage_2_threads"])
def test_accumulation_over_a_last_partial_batch_trains_as_on_one_device(run_dlaunch, two):
    """65 examples in batches of 64, 2 micro-batches: the last batch of one row leaves replica 0 one row for two
    micro-batches and replica 1 none. Every replica still runs two, the missing ones at weight 0: FSDP2 gathers the
    weights at each forward (a replica running one hung in the other's gather), central storage's threads average
    at each backward (one crashed)."""
    args = {"fsdp_1x2": ("strategy=fsdp", "cluster=1x2"), **{k: v[0] for k, v in TWO_REPLICAS.items()}}[two]
    partial = ("input.drop_remainder=false", "recipe.examples=65", "trainer.steps=4", "trainer.grad_accum_steps=2",
               "launch.collective_timeout_s=60")
    runs = {}
    for name, strategy in (("one", ("strategy=one_device",)), ("two", args)):
        proc, run_dir = run_dlaunch(*COMMON, *strategy, *partial, name=name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = summary(run_dir)
    for key in ("final_loss", "param_norm"):  # FSDP's parameters are shards: their norm, not a dump
        assert runs["two"][key] == pytest.approx(runs["one"][key], rel=1e-5), key


OWN_BATCHES = FIXTURES / "own_batches_recipe.py"


@pytest.mark.parametrize("two", list(TWO_REPLICAS))
def test_batches_of_51_rows_and_a_last_of_1_train_as_on_one_device(run_dlaunch, two):
    """51 rows split 26/25 as tf.distribute does, each replica's mean weighted by its rows; the 1-row last batch leaves
    replica 1 none, and its step (a reshape with -1, which fails on 0 rows) is not called with 0 rows."""
    args, _ = TWO_REPLICAS[two]
    runs = {}
    for name, strategy in (("one", ("strategy=one_device",)), ("two", args)):
        proc, run_dir = run_dlaunch(*COMMON, f"recipe.entry={OWN_BATCHES}", "trainer.steps=9", *strategy, name=name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = torch.load(run_dir / "params.pt", weights_only=True), summary(run_dir)
    (one, s1), (two_params, s2) = runs["one"], runs["two"]
    assert_same_model(one, two_params)
    assert s2["final_loss"] == pytest.approx(s1["final_loss"], rel=1e-5)
    assert s1["rows_per_step"] == s2["rows_per_step"] == 51  # as trained; summary.json had only the configured 64


def test_a_recipes_iterable_of_unbatched_elements_is_refused_not_trained_one_example_a_step(run_dlaunch):
    """The API hands a lone replica an unbatched element whole (central storage's numpy example, as TF does); the
    loop trained on it, one example a step, while examples/s counted a global batch of 64."""
    proc, run_dir = run_dlaunch(*COMMON, f"recipe.entry={OWN_BATCHES}", "+recipe.scalars=true", "trainer.steps=3",
                                "strategy=one_device")
    text = " ".join(proc.stderr.replace("│", " ").split())
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "a batch to split across replicas needs a tensor with a first (batch) dimension; this element has none" in text
    assert summary(run_dir)["status"] == "failed"


@pytest.mark.parametrize("two", list(TWO_REPLICAS))
def test_a_last_partial_batch_trains_as_on_one_device(run_dlaunch, two):
    """input.drop_remainder=false over two replicas, once refused: 129 examples in batches of 64 leave a last batch of
    one row, which replica 0 takes alone (tf.distribute's partial batch); its mean counts for the whole step."""
    args, _ = TWO_REPLICAS[two]
    partial = ("input.drop_remainder=false", "recipe.examples=129", "trainer.steps=9")  # three epochs of 64, 64, 1
    one, s1 = final_params(run_dlaunch, "one", "strategy=one_device", *partial)
    other, s2 = final_params(run_dlaunch, "two", *args, *partial)
    assert_same_model(one, other)
    assert s2["final_loss"] == pytest.approx(s1["final_loss"], rel=1e-5)


PER_WORKER = FIXTURES / "per_worker_recipe.py"


@pytest.mark.parametrize("two", list(TWO_REPLICAS))
def test_a_recipes_per_worker_stream_trains_as_the_global_batches_on_one_device(run_dlaunch, two):
    """train_data as a function of an InputContext (a stream each worker reads its own part of, the recipe's
    distribute_datasets_from_function): each worker read every global batch whole and kept its share."""
    args, processes = TWO_REPLICAS[two]
    runs = {}
    for name, entry, strategy in (("one", None, ("strategy=one_device",)), ("two", PER_WORKER, args)):
        proc, run_dir = run_dlaunch(*COMMON, "input.shuffle=false", *((f"recipe.entry={entry}",) if entry else ()),
                                    *strategy, name=name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = summary(run_dir)
    read = [[int(v) for v in (run_dir / f"rows-rank{r}.txt").read_text().split()] for r in range(processes)]
    if processes == 2:  # rank 0 reads rows 0-31 of each global batch of 64, rank 1 rows 32-63
        assert read[0][:2] == [0, 64] and read[1][:2] == [32, 96]
    else:  # one process, one pipeline: its two replicas take a 32-row batch each per step
        assert read[0][:4] == [0, 32, 64, 96]
    for key in ("final_loss", "param_norm"):
        assert runs["two"][key] == pytest.approx(runs["one"][key], rel=1e-5), key


def test_a_per_worker_stream_that_ends_early_on_one_worker_steps_it_at_weight_0(run_dlaunch):
    """Rank 1's part ends one global batch before rank 0's each pass: its replica stepped on an empty batch (a NaN
    mean: the run ended as diverged). The step's rows are every worker's, added up; rank 1 steps at weight 0."""
    proc, run_dir = run_dlaunch(*COMMON, "input.shuffle=false", f"recipe.entry={PER_WORKER}", "+recipe.short_pipeline=1",
                                "recipe.examples=256", "strategy=mirrored", "cluster=1x2", name="short")
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = [[int(v) for v in (run_dir / f"rows-rank{r}.txt").read_text().split()] for r in (0, 1)]
    assert read[0][:5] == [0, 64, 128, 192, 0] and read[1][:4] == [32, 96, 160, 32]  # 4 steps a pass, rank 1 reads 3
    assert summary(run_dir)["final_loss"] < summary(run_dir)["first_loss"]
