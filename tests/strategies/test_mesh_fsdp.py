"""strategy=mesh with data_parallel=fsdp: FSDP2 over the replica dim x tensor parallelism, on real gloo processes."""

from __future__ import annotations

import pytest
import torch

from launcher.distribute.device_assignment import DeviceAssignment, Topology
from launcher.launch.function import run_function
from tests.conftest import summary

FSDP = ("recipe=tp_mlp", "strategy=mesh", "strategy.data_parallel=fsdp")
STEPS = ("trainer.steps=40", "trainer.checkpoint.every_steps=20")
# float32 sums of the same per-example gradients in another order (reduce-scatter over dp, all-reduce over tp) differ
# by a few ulps (~1e-7 relative) per step; 40 momentum steps keep that well under 1e-5 (as for strategy=fsdp).
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def test_dry_run_shows_dp_as_fsdp_and_the_memory_per_rank(run_dlaunch):
    proc, _ = run_dlaunch(*FSDP, "cluster=1x4", "launch.dry_run=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())
    assert "dp 2 (replica dim: FSDP, sharded) x tp 2 (logical dim: tensor parallel) = 4 devices" in text, proc.stdout
    assert "dp: FSDP2 fully_shard over the replica dim (sharded" in text
    # tp_mlp: 32x256 + 256 + 256x4 + 4 = 9,476 fp32 parameters = 37,904 bytes; SGD with momentum: 1 state tensor;
    # DDP: 3 x 37,904 = 113,712 bytes; dp 2 x tp 2 = 4 pieces: 28,428 bytes.
    assert "per rank: 28,428 bytes = 1/4 of DDP's 113,712 bytes (37,904 bytes parameters" in text, proc.stdout
    assert "FSDP 2 x TP 2, approximate" in text


def test_a_mesh_that_does_not_fill_the_cluster_exits_2_with_the_arithmetic(run_dlaunch):
    proc, _ = run_dlaunch(*FSDP, "cluster=1x2", "strategy.device_assignment.num_replicas=2")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, out
    assert "strategy.device_assignment.num_replicas" in out
    assert "dp 2 x tp 2 = 4 devices, but cluster 1x2 has 2" in out
    assert "Traceback" not in out


def fsdp_x_tp_shards() -> dict:
    """tp_mlp on dp 2 (FSDP) x tp 2: each parameter's placements, and what a rank holds after one SGD-momentum step."""
    from launcher.recipes import tp_mlp
    from launcher.strategies.impl.fsdp import local_bytes
    from launcher.strategies.impl.mesh import MeshStrategy
    from launcher.strategies.impl.mesh_fsdp import ShardedReplicas

    s = MeshStrategy(DeviceAssignment.build(Topology.from_devices(4), [2], num_replicas=2), data_parallel=ShardedReplicas())
    cfg = tp_mlp.Config(name="tp_mlp", entry="launcher.recipes.tp_mlp", hidden=64)
    torch.manual_seed(0)
    model = tp_mlp.tensor_parallel(tp_mlp.MLP(cfg.features, cfg.hidden, cfg.outputs), s.logical_mesh)
    whole = sum(p.numel() * p.element_size() for p in tp_mlp.MLP(cfg.features, cfg.hidden, cfg.outputs).parameters())
    model, optimizer = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(torch.randn(8, cfg.features)).square().mean().backward()
    optimizer.step()
    placements = {n: (p.device_mesh.mesh_dim_names, [type(x).__name__ for x in p.placements]) for n, p in model.named_parameters()}
    return {"local": local_bytes(model, optimizer), "ddp": whole * 3, "placements": placements,
            "optimizer": type(optimizer).__name__}


@pytest.mark.slow
def test_fsdp_x_tp_shards_each_parameter_over_both_dims_and_a_rank_holds_a_quarter():
    """dp 2 x tp 2: every parameter a 2-D DTensor, FSDP on the replica dim; a rank holds 1/4 of DDP's bytes
    but for fc2's bias, which RowwiseParallel leaves whole on tp (4 floats x 3, split 2 ways, not 4)."""
    for r in run_function(fsdp_x_tp_shards, device="cpu", nproc=4).values():
        assert r["optimizer"] == "SGD"  # FSDP averages the gradients: no MeshOptimizer all-reduce on top
        for name, (dims, kinds) in r["placements"].items():
            assert dims == ("replica", "logical") and kinds[0] in ("Shard", "_StridedShard"), (name, kinds)
        assert r["placements"]["fc2.bias"][1] == ["Shard", "Replicate"]  # FSDP's dim only
        assert r["local"] == r["ddp"] // 4 + 4 * 4 * 3 // 4, r


@pytest.mark.slow
@pytest.mark.timeout(900)  # four dlaunch runs of 4 processes; slow on a loaded 2-core machine
def test_fsdp_x_tp_trains_like_one_device_and_its_2d_checkpoints_reshard(run_dlaunch):
    """dp 2 (FSDP2) x tp 2 on 1x4 vs one device; its 2-D DTensor checkpoint resumes as dp 2 x tp 1 on 1x2 and on one device."""
    from launcher.checkpoint import layout, read_tensors

    proc, mesh_dir = run_dlaunch(*FSDP, *STEPS, "cluster=1x4", name="fsdp_tp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # dlaunch's own norms of 2-D DTensors: torch warned on every rank that it redistributes them in two collectives
    assert "While redistributing" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    proc, one_dir = run_dlaunch("recipe=tp_mlp", *STEPS, name="one")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(mesh_dir)
    assert (s["num_replicas_in_sync"], s["world_size"]) == (2, 4)
    final = {name: read_tensors(layout.step_dir(d / "checkpoints", 40)) for name, d in (("mesh", mesh_dir), ("one", one_dir))}
    assert final["one"].keys() == final["mesh"].keys()
    for key, value in final["one"].items():
        torch.testing.assert_close(final["mesh"][key], value, **TOLERANCE, msg=key)

    halfway = layout.step_dir(mesh_dir / "checkpoints", 20)
    for name, layout_args in (("fsdp_only", (*FSDP, "cluster=1x2", "strategy.device_assignment.computation_shape=[1]")),
                              ("one_device", ("recipe=tp_mlp",))):
        proc, run_dir = run_dlaunch(*layout_args, *STEPS, f"trainer.resume={halfway}", name=name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert summary(run_dir)["resumed_from_step"] == 20
        resumed = read_tensors(layout.step_dir(run_dir / "checkpoints", 40))
        for key, value in final["mesh"].items():
            torch.testing.assert_close(resumed[key], value, **TOLERANCE, msg=f"{name}: {key}")


@pytest.mark.slow
def test_adagrad_state_split_by_tensor_parallelism_is_sharded_over_both_dims(run_dlaunch):
    """Adagrad makes its sum when it is built, on the tp-split (DTensor) parameters: FSDP x TP re-places it. Step 3's
    batch is one row, accumulated in 2 micro-batches: every replica runs both (a short share repeats at weight 0)."""
    adagrad = ("recipe=tp_mlp", "trainer.steps=4", "recipe.optimizer.name=adagrad", "recipe.examples=65",
               "input.global_batch_size=32", "input.drop_remainder=false", "trainer.grad_accum_steps=2")
    proc, mesh_dir = run_dlaunch(*adagrad, "strategy=mesh", "strategy.data_parallel=fsdp", "cluster=1x4", name="mesh")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, one_dir = run_dlaunch(*adagrad, name="one")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(mesh_dir)["final_loss"] == pytest.approx(summary(one_dir)["final_loss"], rel=1e-5)
