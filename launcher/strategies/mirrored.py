"""``strategy=mirrored``: synchronous data parallelism, one process per device (``MirroredStrategy``, DDP).

The torch side is ``impl/mirrored.py``; ``multi_worker_mirrored`` shares this spec.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from launcher.config.base import PlanError
from launcher.strategies import forward, unit
from launcher.strategies.base import Rule, StrategyUnit

# The names a config may give as strategy.cross_device_ops (null: the default all-reduce).
CrossDeviceOpsName = Literal["nccl_all_reduce", "hierarchical_copy", "reduction_to_one_device", "shared_memory"]


@unit
class MirroredSpec(StrategyUnit):
    """``strategy=mirrored``: synchronous data parallelism, one process per device (DDP)."""

    name: Literal["mirrored"]
    bucket_cap_mb: float = Field(25.0, gt=0, le=4096, description="DDP gradient bucket size")
    gradient_as_bucket_view: bool = Field(True, description="DDP's: gradients are views into its buckets (no copy)")
    find_unused_parameters: bool = Field(False, description="DDP's: for models whose forward leaves some parameters unused")
    cross_device_ops: CrossDeviceOpsName | None = Field(
        None, description=(
            "how gradients and reduce() combine replicas; null: shared memory between CPU processes "
            "of one machine, else DDP's own all-reduce"
        )
    )
    impl: ClassVar[str] = "launcher.strategies.impl.mirrored"
    exports: ClassVar[tuple[str, ...]] = ("MirroredStrategy",)
    example: ClassVar[tuple[str, ...]] = ("cluster=1x2",)

    def replicas(self, cluster: Any) -> int:
        return cluster.world_size

    def describe(self) -> str:
        return f"{self.name} ({self._reduction()}, {self.bucket_cap_mb:g} MB buckets)"

    def _reduction(self) -> str:
        if self.cross_device_ops is None:
            return "DDP all-reduce, through shared memory on one CPU machine"
        return f"DDP + cross_device_ops {self.cross_device_ops}"

    def device_rules(self) -> tuple[Rule, ...]:
        return (shared_memory_fits,)

    def ddp_options(self) -> dict:
        """Keyword arguments for ``DistributedDataParallel``."""
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "find_unused_parameters": self.find_unused_parameters,
        }


def shared_memory_fits(spec: Any, cuda: int) -> None:
    """``cross_device_ops=shared_memory`` reduces CPU tensors (that the processes share one machine is checked when they start)."""
    if spec.strategy.cross_device_ops != "shared_memory":
        return
    if spec.device_type(cuda) == "cuda":
        raise PlanError("strategy.cross_device_ops", "shared_memory",
                        "shared_memory reduces CPU tensors; on CUDA use null (nccl) or nccl_all_reduce")


__getattr__ = forward(__name__, MirroredSpec.impl)
