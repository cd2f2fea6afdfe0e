"""The performance benchmark's workload: an MLP 784-1024-1024-10 on synthetic data.

Run it:

    dlaunch recipe=bench_mlp                                 # one device
    dlaunch recipe=bench_mlp strategy=mirrored cluster=1x2   # two replicas (processes)
    make bench                                               # every variant, interleaved, vs hand-written torch

The workload is fixed so that timings compare: an MLP 784-1024-1024-10 with ReLU
(1,863,690 parameters, 7.45 MB in fp32), 65,536 synthetic examples held in
memory, global batch 256, SGD with momentum, 200 steps, cross-entropy. The
inputs are standard normal; the labels are the argmax of a fixed random linear
teacher, so the loss falls. Everything comes from ``trainer.seed``: every
replica builds the same dataset and the same initial parameters, and dlaunch
shuffles it with ``input.seed + epoch``. ``benchmarks/`` rebuilds the same
data and model in hand-written torch, so the final losses can be compared.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn
from torch.utils.data import TensorDataset

from launcher.runtime.recipe import BuildContext, OptimizerConfig, Parts, RecipeConfig


class Config(RecipeConfig):
    inputs: int = Field(784, gt=0)
    hidden: int = Field(1024, gt=0)
    classes: int = Field(10, gt=1)
    examples: int = Field(65536, gt=0)
    optimizer: OptimizerConfig = OptimizerConfig(lr=0.05, momentum=0.9)


def make_model(cfg: Config) -> nn.Module:
    """784 -> 1024 -> 1024 -> 10, ReLU between; initialised from torch's global RNG (seeded by dlaunch)."""
    return nn.Sequential(
        nn.Linear(cfg.inputs, cfg.hidden), nn.ReLU(),
        nn.Linear(cfg.hidden, cfg.hidden), nn.ReLU(),
        nn.Linear(cfg.hidden, cfg.classes),
    )


def make_data(cfg: Config, seed: int) -> TensorDataset:
    """``examples`` standard-normal inputs, labelled by a fixed random linear teacher; its own generator (seed + 1)."""
    g = torch.Generator().manual_seed(seed + 1)
    teacher = torch.randn(cfg.inputs, cfg.classes, generator=g)
    x = torch.randn(cfg.examples, cfg.inputs, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x, y)


def build(cfg: Config, ctx: BuildContext) -> Parts:
    """The model first (global RNG), then the data (its own generator): the order the baselines use too."""
    model = make_model(cfg)
    return Parts(model=model, optimizer=cfg.optimizer.build(model.parameters()), train_data=make_data(cfg, ctx.seed))


def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One replica's share of a global batch -> its mean cross-entropy. dlaunch does backward and the update."""
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
