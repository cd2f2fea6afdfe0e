"""A diverged run: what it says (the step, the last one known finite) and that every rank agrees before a save."""

from __future__ import annotations

import math

import torch

from launcher.launch.function import run_function
from launcher.runtime.divergence import loss_not_finite, non_finite_parameters


def test_a_loss_read_some_steps_after_the_last_known_finite_one_says_since_when():
    assert str(loss_not_finite(float("nan"), 1, 0)) == "loss is nan at step 1; lower recipe.optimizer.lr or check the data"
    assert str(loss_not_finite(float("nan"), 21, 20)) == "loss is nan at step 21; lower recipe.optimizer.lr or check the data"
    said = str(loss_not_finite(float("inf"), 30, 20))
    assert said.startswith("loss is inf at step 30 (last known finite at step 20; trainer.log_every=1 finds the first step")


def test_only_trainable_parameters_count_a_frozen_mask_may_hold_minus_inf():
    model = torch.nn.Linear(3, 2)
    assert float(non_finite_parameters(model)) == 0.0
    with torch.no_grad():
        model.weight[0, 1] = float("nan")
    assert float(non_finite_parameters(model)) == 1.0
    with torch.no_grad():
        model.weight[0, 1] = -math.inf
    assert float(non_finite_parameters(model)) == 1.0
    model.weight.requires_grad_(False)
    assert float(non_finite_parameters(model)) == 0.0
    model.bias = torch.nn.Parameter(torch.empty(0))  # a rank's empty shard of a small tensor (fsdp on 1x4)
    assert float(non_finite_parameters(model)) == 0.0


def nan_in_one_logical_devices_shard() -> bool:
    """tp_mlp split over 2 logical devices of one replica; NaN in logical device 0's shard of fc1 alone."""
    from launcher.distribute.device_assignment import DeviceAssignment, Topology
    from launcher.recipes import tp_mlp
    from launcher.runtime.divergence import parameters_diverged
    from launcher.strategies.impl.mesh import MeshStrategy
    import torch.distributed as dist

    s = MeshStrategy(DeviceAssignment.build(Topology.from_devices(2), [2], num_replicas=1))
    cfg = tp_mlp.Config(name="tp_mlp", entry="launcher.recipes.tp_mlp", hidden=16)
    torch.manual_seed(0)
    model = tp_mlp.tensor_parallel(tp_mlp.MLP(cfg.features, cfg.hidden, cfg.outputs), s.logical_mesh)
    model, _ = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if dist.get_rank() == 0:
        with torch.no_grad():
            model.fc1.weight.to_local()[0, 0] = float("nan")
    return parameters_diverged(s, model)


def test_every_rank_of_a_mesh_agrees_when_one_logical_devices_shard_diverged():
    """The mesh's reduce runs over the replica dim: logical device 1 said "finite" and went into DCP's save alone."""
    assert run_function(nan_in_one_logical_devices_shard, device="cpu", nproc=2) == {0: True, 1: True}
