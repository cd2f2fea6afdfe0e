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
from typing import Any, Sequence

import torch

from launcher.strategies.impl.fsdp import fsdp_options, shard, wrapped_units

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
