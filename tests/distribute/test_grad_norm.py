"""The total norm of gradients in mixed layouts (plain, DTensor on one mesh, DTensor on another), in real gloo processes."""

from __future__ import annotations

import pytest
import torch

from launcher.launch.function import run_function

pytestmark = pytest.mark.slow


def mixed_layouts() -> dict:
    """A plain gradient, one split over a 1-D mesh of 2 and one replicated over a 2-D mesh's column: clipped to 1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from launcher.distribute.grad_norm import clip_grad_norm

    dist.init_process_group("gloo")
    line = init_device_mesh("cpu", (2,))
    grid = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    whole = [torch.arange(1.0, 7.0).reshape(3, 2), torch.arange(4.0).reshape(4, 1) - 1.5, torch.full((3,), 2.0)]
    params = [torch.nn.Parameter(torch.zeros(3, 2)),
              torch.nn.Parameter(distribute_tensor(torch.zeros(4, 1), line, [Shard(0)])),
              torch.nn.Parameter(distribute_tensor(torch.zeros(3), grid["tp"], [Replicate()]))]
    params[0].grad = whole[0].clone()
    params[1].grad = distribute_tensor(whole[1].clone(), line, [Shard(0)])
    params[2].grad = distribute_tensor(whole[2].clone(), grid["tp"], [Replicate()])
    norm = clip_grad_norm(params, 1.0)
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    return {"norm": float(norm), "whole": whole, "clipped": grads, "after": float(clip_grad_norm(params, None))}


def test_a_norm_over_plain_and_split_gradients_counts_each_once_and_clips_them_all():
    """torch's clip_grad_norm_ refused this mix (mixed torch.Tensor and DTensor; operands on different meshes)."""
    for r in run_function(mixed_layouts, device="cpu", nproc=2).values():
        expected = torch.cat([w.flatten() for w in r["whole"]]).norm().item()
        assert r["norm"] == pytest.approx(expected, rel=1e-6)
        scale = 1.0 / (expected + 1e-6)
        for got, want in zip(r["clipped"], r["whole"]):
            torch.testing.assert_close(got, want * scale)
        assert r["after"] == pytest.approx(1.0, rel=1e-5)
