"""The bench_mlp recipe (the workload of benchmarks/ and docs/PERFORMANCE.md): its shapes, and steady_ms_per_step.

No timing is asserted here: how fast it runs is the benchmark's business (make bench).
"""

from __future__ import annotations

import json
import math

import torch
import yaml

from launcher.cli.main import main
from launcher.config.compose import recipe_files
from launcher.recipes import bench_mlp

PARAMETERS = 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10  # 1,863,690: 7.45 MB in fp32


def test_the_workload_has_the_stated_shapes():
    cfg = bench_mlp.Config(name="bench_mlp", entry="launcher.recipes.bench_mlp")
    model = bench_mlp.make_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS == 1_863_690
    assert [tuple(m.weight.shape) for m in model if isinstance(m, torch.nn.Linear)] == [(1024, 784), (1024, 1024), (10, 1024)]
    assert sum(isinstance(m, torch.nn.ReLU) for m in model) == 2
    data = bench_mlp.make_data(cfg, seed=0)
    x, y = data.tensors
    assert x.shape == (65536, 784) and x.dtype == torch.float32 and y.shape == (65536,)
    assert int(y.min()) >= 0 and int(y.max()) <= 9 and len(torch.unique(y)) == 10
    again = bench_mlp.make_data(cfg.model_copy(update={"examples": 64}), seed=0)
    assert torch.equal(again.tensors[0], x[:64])  # a fixed seed: the same examples every time
    optimizer = cfg.optimizer.build(model.parameters())
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9


def test_the_yaml_declares_the_issue_workload():
    text = recipe_files()["bench_mlp"].read_text()
    lines = text.splitlines()
    assert lines[0].startswith("# dlaunch recipe=bench_mlp") and lines[1] == "# @package _global_"
    data = yaml.safe_load(text)
    assert data["recipe"]["strategies"] == ["one_device", "mirrored", "multi_worker_mirrored", "central_storage"]
    assert data["input"]["global_batch_size"] == 256 and data["trainer"]["steps"] == 200
    assert data["recipe"]["examples"] == 65536 and data["recipe"]["optimizer"]["name"] == "sgd"


def _summary(tmp_path, steps: int) -> dict:
    run_dir = tmp_path / f"run{steps}"
    assert main(["recipe=bench_mlp", "cluster.device=cpu", "recipe.examples=4096", f"trainer.steps={steps}", f"hydra.run.dir={run_dir}"]) == 0
    return json.loads((run_dir / "summary.json").read_text())


def test_a_run_of_25_steps_writes_a_steady_step_time(tmp_path):
    summary = _summary(tmp_path, 25)
    steady = summary["steady_ms_per_step"]
    assert isinstance(steady, float) and math.isfinite(steady) and steady > 0, summary
    assert summary["final_loss"] < summary["first_loss"]


def test_a_run_of_10_steps_has_no_steady_state(tmp_path):
    summary = _summary(tmp_path, 10)
    assert "steady_ms_per_step" in summary and summary["steady_ms_per_step"] is None
