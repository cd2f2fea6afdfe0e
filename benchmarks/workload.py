"""The benchmark workload in hand-written torch (no dlaunch import): the same data, model and order as ``recipe=bench_mlp``.

Kept apart from ``recipes/bench_mlp.py`` on purpose: the baselines must not pay
for importing dlaunch. The harness checks that they agree with the recipe by
comparing the final losses (they match to float rounding).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

INPUTS, HIDDEN, CLASSES = 784, 1024, 10
EXAMPLES = 65536
GLOBAL_BATCH = 256
LR, MOMENTUM = 0.05, 0.9


def make_model() -> nn.Module:
    """As ``recipes/bench_mlp.make_model``: 784 -> 1024 -> 1024 -> 10, ReLU, from torch's global RNG."""
    return nn.Sequential(nn.Linear(INPUTS, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def make_data(seed: int) -> TensorDataset:
    """As ``recipes/bench_mlp.make_data``: standard-normal inputs, labels from a fixed random linear teacher."""
    g = torch.Generator().manual_seed(seed + 1)
    teacher = torch.randn(INPUTS, CLASSES, generator=g)
    x = torch.randn(EXAMPLES, INPUTS, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def epoch_order(seed: int, epoch: int) -> list[int]:
    """dlaunch's ``EpochBatchSampler`` order (and ``DistributedSampler``'s): randperm seeded with ``seed + epoch``."""
    return torch.randperm(EXAMPLES, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def logged(step: int, steps: int, every: int = 20) -> bool:
    """The steps whose loss dlaunch reads and logs with bench_mlp's ``log_every: 20``: 1, every 20th, the last."""
    return step == 1 or step % every == 0 or step == steps


def write_result(path: str | Path, *, first_step_time: float, step_seconds: list[float], logged_losses: dict[int, float],
                 **extra) -> None:
    """What the harness reads: the wall-clock time at the end of step 1, every step's seconds, the logged losses."""
    steps = sorted(logged_losses)
    Path(path).write_text(json.dumps({
        "first_step_time": first_step_time, "step_seconds": step_seconds,
        "logged_losses": {str(s): logged_losses[s] for s in steps},
        "first_loss": logged_losses[steps[0]], "final_loss": logged_losses[steps[-1]], "written": time.time(), **extra,
    }))
