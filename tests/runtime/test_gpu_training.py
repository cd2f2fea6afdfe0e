"""On a GPU (skipped elsewhere; CI has none): the default command, every shipped recipe, one seed's
initialisation on either device, mixed precision, torch.compile, and a bitwise resume on CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from launcher import distribute as dl
from launcher.runtime import recipe as recipe_lib
from tests.checkpoint.test_resume import assert_bitwise_equal, final_state
from tests.conftest import summary

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RECIPES = {  # each shipped recipe under the default strategy (one_device) and device (auto)
    "linear": (), "digits": (), "wide_deep": (), "bench_mlp": (), "charlm": ("trainer.steps=5",),
    "tp_mlp": (),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_default_device_runs_every_recipe_on_the_gpu(run_dlaunch, name):
    """Plain ``dlaunch recipe=NAME``: ``auto`` picks CUDA (issue 15: the build used to fail on a CPU generator)."""
    proc, run_dir = run_dlaunch(f"recipe={name}", "trainer.steps=10", *RECIPES[name], device=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(run_dir)["device"] == "cuda"


def test_plain_dlaunch_runs_on_the_gpu(run_dlaunch):
    proc, run_dir = run_dlaunch("trainer.steps=20", device=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(run_dir)["device"] == "cuda"


def test_one_seed_gives_the_same_initial_parameters_on_cpu_and_cuda(tmp_path):
    from launcher.config.compose import compose_and_validate

    spec = compose_and_validate(["recipe=charlm", "cluster.device=cpu"], cuda_devices=0)
    loaded = recipe_lib.load(spec.recipe.model_dump())
    built = {}
    for device in ("cpu:0", "cuda:0"):
        strategy = dl.OneDeviceStrategy(device)
        ctx = recipe_lib.BuildContext(strategy=strategy, seed=0, global_batch_size=48, per_replica_batch_size=48,
                                      num_replicas_in_sync=1, run_dir=tmp_path, is_chief=True)
        torch.manual_seed(0)
        with strategy.scope():
            built[device] = loaded.module.build(loaded.config, ctx)
    cuda = built["cuda:0"]
    assert {p.device.type for p in cuda.model.parameters()} == {"cuda"}
    for a, b in zip(built["cpu:0"].model.state_dict().values(), cuda.model.state_dict().values()):
        assert torch.equal(a, b.cpu())
    # CPU-to-CUDA moves keep the Parameter objects: the optimizer built in the scope holds the moved ones
    held = {id(p) for group in cuda.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in cuda.model.parameters()}


@pytest.mark.parametrize("extra", [
    ("trainer.precision=bf16-mixed",),
    ("trainer.precision=fp16-mixed",),
    ("trainer.precision=bf16-mixed", "trainer.compile.enabled=true"),
    ("trainer.precision=bf16-mixed", "trainer.compile.enabled=true", "trainer.compile.mode=reduce-overhead",
     "trainer.eval_every=20", "recipe.sample_chars=8"),
    ("trainer.precision=bf16-mixed", "trainer.grad_accum_steps=2", "trainer.clip_grad_norm=1.0",
     "trainer.lr_schedule.decay=cosine", "trainer.lr_schedule.warmup_steps=5"),
    ("trainer.precision=bf16-mixed", "trainer.compile.enabled=true", "trainer.activation_checkpointing=[TransformerEncoderLayer]"),
], ids=["bf16", "fp16", "bf16-compile", "bf16-cuda-graphs-eval", "bf16-accum-clip-cosine", "bf16-compile-recompute"])
def test_charlm_trains_in_mixed_precision_on_the_gpu(run_dlaunch, extra):
    proc, run_dir = run_dlaunch("recipe=charlm", "trainer.steps=40", "trainer.log_every=10", "cluster.device=cuda", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert records[-1]["loss"] < records[0]["loss"]
    if "trainer.precision=fp16-mixed" in extra:
        assert "skipped_steps" in records[-1]


def test_cuda_resume_with_mixed_precision_and_a_schedule_is_bitwise_equal(run_dlaunch):
    common = ("recipe=charlm", "cluster.device=cuda", "trainer.steps=30", "trainer.log_every=1", "trainer.checkpoint.every_steps=5",
              "trainer.checkpoint.keep=10", "trainer.precision=fp16-mixed", "trainer.grad_accum_steps=2",
              "trainer.lr_schedule.decay=cosine", "trainer.lr_schedule.warmup_steps=4")
    proc, straight = run_dlaunch(*common, name="straight")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, resumed = run_dlaunch(*common, f"trainer.resume={straight / 'checkpoints' / 'step-00000015'}", name="resumed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b in zip(final_state(straight), final_state(resumed)):
        assert_bitwise_equal(a, b)


def test_mirrored_and_mesh_run_on_one_gpu(run_dlaunch):
    for args in (("strategy=mirrored", "cluster=1x1"), ("recipe=tp_mlp", "strategy=mesh", "cluster=1x1",
                                                          "strategy.device_assignment.computation_shape=[1]")):
        proc, run_dir = run_dlaunch(*args, "trainer.steps=10", "trainer.precision=bf16-mixed", "cluster.device=cuda",
                                    name=args[0].split("=")[1])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert summary(run_dir)["device"] == "cuda"


def test_a_step_that_calls_the_model_twice_trains_under_cuda_graphs(run_dlaunch, tmp_path):
    """compile mode reduce-overhead, and a step that keeps a no_grad output while it calls the model again: torch's
    own guess would start a new iteration at the second call and overwrite the first output (step.begin)."""
    from tests.conftest import ROOT

    old = "    return torch.nn.functional.mse_loss(model(x), y)"
    source = (ROOT / "recipes" / "linear.py").read_text()
    assert old in source
    (tmp_path / "anchored.py").write_text(source.replace(old, (
        "    with torch.no_grad():\n"
        "        anchor = model(x)  # kept while the model runs again\n"
        "    out = model(x)\n"
        "    return torch.nn.functional.mse_loss(out, y) + (out - anchor).pow(2).mean()")))
    proc, run_dir = run_dlaunch(f"recipe={tmp_path / 'anchored.py'}", "trainer.steps=30", "trainer.log_every=10",
                                "trainer.eval_every=10", "cluster.device=cuda", "trainer.compile.enabled=true",
                                "trainer.compile.mode=reduce-overhead")
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = summary(run_dir)
    assert found["final_loss"] < found["first_loss"] / 4  # 45.9 -> 5.9 on the CPU, compiled without graphs
