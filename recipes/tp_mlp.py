"""A tensor-parallel MLP: the first layer split by columns, the second by rows, over each replica's logical devices.

Run it:

    dlaunch recipe=tp_mlp strategy=mesh cluster=1x4      # 2 replicas x 2 logical devices (the default)
    dlaunch recipe=tp_mlp strategy=mesh cluster=1x4 'strategy.device_assignment.computation_shape=[1,1,1,4]'
    dlaunch recipe=tp_mlp                                # one device, unsplit

Megatron's split: ``fc1`` (features -> hidden) is split by output columns, so each
logical device computes its slice of the hidden units; ``fc2`` (hidden -> outputs)
is split by input rows, so each device multiplies its slice and one all-reduce
sums the parts. The activation needs no communication. torch's tensor
parallelism does the splitting (``ColwiseParallel``, ``RowwiseParallel`` over
``strategy.logical_mesh``); MeshStrategy averages gradients over the replicas.
The targets come from a fixed random teacher MLP, so the loss falls towards the
noise floor.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch.utils.data import TensorDataset

from launcher.runtime.recipe import BuildContext, OptimizerConfig, Parts, RecipeConfig


class Config(RecipeConfig):
    features: int = Field(32, gt=0)
    hidden: int = Field(256, gt=0)  # split across the logical devices: a multiple of their number
    outputs: int = Field(4, gt=0)
    examples: int = Field(8192, gt=0)
    eval_examples: int = Field(1024, gt=0)
    noise: float = Field(0.05, ge=0)
    optimizer: OptimizerConfig = OptimizerConfig(lr=0.05, momentum=0.9)


class MLP(torch.nn.Module):
    def __init__(self, features: int, hidden: int, outputs: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(features, hidden)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def tensor_parallel(model: MLP, logical_mesh) -> MLP:
    """fc1 by columns, fc2 by rows: one all-reduce per forward (and one per backward) inside a replica."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, logical_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def make_data(cfg: Config, seed: int) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(seed + 1)
    teacher = [torch.randn(cfg.features, 64, generator=g) / cfg.features**0.5, torch.randn(64, cfg.outputs, generator=g) / 8]

    def sample(n: int) -> TensorDataset:
        x = torch.randn(n, cfg.features, generator=g)
        y = torch.tanh(x @ teacher[0]) @ teacher[1] + cfg.noise * torch.randn(n, cfg.outputs, generator=g)
        return TensorDataset(x, y)

    return sample(cfg.examples), sample(cfg.eval_examples)


def build(cfg: Config, ctx: BuildContext) -> Parts:
    model = MLP(cfg.features, cfg.hidden, cfg.outputs)
    logical_mesh = getattr(ctx.strategy, "logical_mesh", None)
    if logical_mesh is not None and logical_mesh.size() > 1:
        if cfg.hidden % logical_mesh.size():
            raise ValueError(f"recipe.hidden={cfg.hidden} does not split over {logical_mesh.size()} logical devices")
        model = tensor_parallel(model, logical_mesh)
    train, held_out = make_data(cfg, ctx.seed)
    return Parts(model=model, optimizer=cfg.optimizer.build(model.parameters()), train_data=train, eval_data=held_out)


def train_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def evaluate(model: torch.nn.Module, parts: Parts) -> dict[str, float]:
    """Held-out mean squared error (the noise floor is noise**2)."""
    x, y = parts.eval_data.tensors
    device = next(model.parameters()).device
    return {"eval_loss": torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).item()}
