"""Linear regression on synthetic data, or on files with fields ``x`` and ``y``.

Run it:

    dlaunch recipe=linear                                # one device
    dlaunch recipe=linear strategy=mirrored cluster=1x2  # two replicas (processes)

    python -m launcher.recipes.linear data/ --shards 4   # write the training set as 4 jsonl files
    dlaunch recipe=linear strategy=mirrored cluster=1x2 'input.files=data/train-*.jsonl'

The data is generated from a fixed seed, so every replica builds the same
dataset; dlaunch shuffles it, cuts global batches and gives each replica its
share. With ``input.files`` set, dlaunch reads the files instead and shards them
across worker processes (``input.auto_shard_policy``). ``train_step`` is plain
torch and runs unchanged under every strategy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from pydantic import Field
from torch.utils.data import TensorDataset

from launcher.input.files import FORMATS, write_shards
from launcher.runtime.recipe import BuildContext, OptimizerConfig, Parts, RecipeConfig


class Config(RecipeConfig):
    features: int = Field(32, gt=0)
    examples: int = Field(8192, gt=0)
    eval_examples: int = Field(1024, gt=0)
    noise: float = Field(0.1, ge=0)
    optimizer: OptimizerConfig = OptimizerConfig(lr=0.05, momentum=0.9)


def make_data(cfg: Config, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Train and held-out sets from one ground-truth linear map."""
    g = torch.Generator().manual_seed(seed + 1)
    w_true = torch.randn(cfg.features, 1, generator=g)
    b_true = torch.randn(1, generator=g)

    def sample(n: int) -> TensorDataset:
        x = torch.randn(n, cfg.features, generator=g)
        y = x @ w_true + b_true + cfg.noise * torch.randn(n, 1, generator=g)
        return TensorDataset(x, y)

    return sample(cfg.examples), sample(cfg.eval_examples)


def build(cfg: Config, ctx: BuildContext) -> Parts:
    """Called inside strategy.scope(): parameters land on the strategy's device."""
    model = torch.nn.Linear(cfg.features, 1)
    train_data, eval_data = make_data(cfg, ctx.seed)
    if ctx.input_files is not None:  # input.files: batches of the files' x and y, sharded by dlaunch
        ctx.input_files.check_width("x", cfg.features, "recipe.features")
        train_data = ctx.input_files.select("x", "y")
    return Parts(model=model, optimizer=cfg.optimizer.build(model.parameters()), train_data=train_data, eval_data=eval_data)


def train_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One replica's share of a global batch -> its mean loss. dlaunch does backward and the update."""
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def evaluate(model: torch.nn.Module, parts: Parts) -> dict[str, float]:
    """Held-out mean squared error; the noise floor is noise**2."""
    x, y = parts.eval_data.tensors
    device = next(model.parameters()).device
    return {"eval_loss": torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).item()}


def write_files(directory: str | Path, shards: int = 4, fmt: str = "jsonl", seed: int = 0) -> list[Path]:
    """The generated training set as ``shards`` files with fields x and y (``evaluate`` still uses the same seed's held-out set)."""
    train, _ = make_data(Config(name="linear", entry=__name__), seed)
    x, y = train.tensors
    return write_shards({"x": x, "y": y}, directory, shards, fmt)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the linear recipe's training set as files for input.files.")
    parser.add_argument("directory")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--format", choices=FORMATS, default="jsonl")
    parser.add_argument("--seed", type=int, default=0, help="the trainer.seed the run will use")
    args = parser.parse_args()
    for path in write_files(args.directory, args.shards, args.format, args.seed):
        print(path)
