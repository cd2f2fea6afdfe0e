"""FSDP x tensor parallelism: the mesh's replica (dp) dimension sharded with FSDP2 (``strategy.data_parallel=fsdp``).

``strategy=mesh`` splits layers over each replica's logical devices (tp, the
``"logical"`` dim of the 2-D DeviceMesh). By default the replicas (dp, the
``"replica"`` dim) each keep a whole copy of their tp shard and average gradients
with one all-reduce. With ``data_parallel: fsdp`` the replicas instead shard it:
``fully_shard`` over ``mesh["replica"]`` after ``parallelize_module`` over
``mesh["logical"]`` (torchtitan's order), so each parameter becomes a 2-D DTensor
and each rank holds ``1 / (dp x tp)`` of it (of its tp shard's ``1 / dp``, where
the tensor-parallel plan leaves a parameter whole). FSDP's reduce-scatter
averages the gradients over the replicas, so the mesh's all-reduce is not used::

    dlaunch recipe=tp_mlp strategy=mesh cluster=1x4 strategy.data_parallel=fsdp   # dp 2 (FSDP) x tp 2
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from launcher.strategies.fsdp import fsdp_options, memory_row, shard, wrapped_units

log = logging.getLogger("dlaunch")


class ShardedReplicas:
    """The replica dimension as FSDP2: what ``MeshStrategy.prepare`` does instead of averaging gradients itself.

    Args mirror ``FSDPStrategy``: ``reshard_after_forward``, ``wrap`` (module class names
    sharded one by one, then the root), ``param_dtype`` (bf16 for mixed precision).
    """

    def __init__(self, reshard_after_forward: bool = True, wrap: Sequence[str] = (), param_dtype: torch.dtype | None = None):
        self.options, self.wrap = fsdp_options(reshard_after_forward, param_dtype), list(wrap)

    def prepare(self, module: torch.nn.Module, optimizer: Any, mesh: Any) -> tuple[torch.nn.Module, Any]:
        """``fully_shard`` the (already tensor-parallel) ``module`` over ``mesh["replica"]``."""
        if mesh is None or mesh["replica"].size() == 1:
            wrapped_units(module, self.wrap)  # a bad name fails here too, before the first step
            log.warning("strategy.data_parallel=fsdp with 1 replica shards nothing: it trains as data_parallel=replicate would")
            return module, optimizer
        return shard(module, optimizer, mesh["replica"], self.options, self.wrap), optimizer


# ---------- the spec side: validation and the plan ----------
def fit_problem(replicas: int, logical: int, computation_shape: Sequence[int], devices: int, where: str) -> str | None:
    """Why dp x tp does not fill the cluster (None when it does), with the arithmetic."""
    if replicas * logical == devices:
        return None
    return (f"dp {replicas} x tp {logical} = {replicas * logical} devices, but {where} (dp: FSDP over "
            f"strategy.device_assignment.num_replicas; tp: the product of computation_shape {list(computation_shape)})")


def describe(spec: Any) -> str:
    """The strategy row's data-parallel part."""
    return f"dp: FSDP2 fully_shard over the replica dim (sharded; {spec.fsdp.describe_units()})"


def plan_rows(spec: Any, run_dir: Path) -> list[tuple[str, str]]:
    """The mesh's dims as dp (FSDP, sharded) x tp, and the per-rank memory of fsdp's plan for dp x tp pieces."""
    dp, tp = spec.num_replicas, spec.strategy.device_assignment.logical_devices
    how = (f"; FSDP {dp} x TP {tp}, approximate: a parameter the tensor-parallel plan leaves whole, "
           f"like RowwiseParallel's bias, is split {dp} ways only") if dp * tp > 1 else ""
    return [
        ("mesh", f"dp {dp} (replica dim: FSDP, sharded) x tp {tp} (logical dim: tensor parallel) = {dp * tp} devices"),
        ("memory", memory_row(spec, run_dir, ways=dp * tp, how=how)),
    ]
