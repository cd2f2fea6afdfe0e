"""``strategy=fsdp``: sharded data parallelism through torch's FSDP2 (``FSDPStrategy``, in ``impl/fsdp.py``).

Each rank keeps ``1/N`` of every parameter, gradient and optimizer state; the
plan shows that memory per rank against DDP's (docs/STRATEGIES_FSDP.md).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from launcher.config.base import Strict
from launcher.strategies import forward, unit
from launcher.strategies.base import StrategyUnit


class FSDPOptions(Strict):
    """How FSDP2 shards a model: ``strategy=fsdp``'s keys, and ``strategy.fsdp`` of ``strategy=mesh``."""

    reshard_after_forward: bool = Field(
        True, description="free each layer's gathered parameters after its forward (gather again for backward): "
                          "less memory, one more all-gather per layer")
    wrap: list[str] = Field(
        default_factory=list, description="nn.Module class names sharded one by one (e.g. TransformerEncoderLayer); "
                                          "empty: the whole model is one unit")

    def policy_note(self, precision: str) -> str:
        """Under bf16-mixed, FSDP's MixedPrecisionPolicy (launcher/strategies/impl/fsdp.py's fsdp_options)."""
        if precision != "bf16-mixed":
            return ""
        return "FSDP MixedPrecisionPolicy: parameters gathered and computed in bf16, gradients reduced in fp32"

    def describe_units(self) -> str:
        units = f"each {', '.join(self.wrap)} then the root" if self.wrap else "the whole model as one unit"
        return f"{units}; reshard after forward: {'yes' if self.reshard_after_forward else 'no'}"


@unit
class FSDPSpec(StrategyUnit, FSDPOptions):
    """``strategy=fsdp``: sharded data parallelism (FSDP2 ``fully_shard``), one process per device."""

    name: Literal["fsdp"]
    impl: ClassVar[str] = "launcher.strategies.impl.fsdp"
    exports: ClassVar[tuple[str, ...]] = ("FSDPStrategy",)
    example: ClassVar[tuple[str, ...]] = ("cluster=1x2",)
    refuses: ClassVar[dict[str, str]] = {
        "fp16-mixed": "GradScaler checks only this rank's gradient shard for inf/NaN, so ranks could disagree on "
                      "skipping a step; use trainer.precision=bf16-mixed (FSDP's MixedPrecisionPolicy, no scaler)",
        "fused-non-adam": "its parameters are DTensors, and torch's DTensor has fused kernels for Adam and AdamW only; "
                     "use recipe.optimizer.implementation=foreach",
    }

    init_from: Literal["every_rank", "rank0"] = Field(
        "every_rank", description="every_rank: each rank builds the whole model on the CPU from the same seed; rank0: "
                                  "rank 0 alone does, the others build it on the meta device and get rank 0's values "
                                  "once it is sharded (one copy in host memory, not one per rank)")

    def replicas(self, cluster: Any) -> int:
        return cluster.world_size

    def refusal(self, feature: str, spec: Any) -> str | None:
        if feature == "state-at-build" and self.init_from == "rank0" and spec.num_replicas > 1:
            return ("with strategy.init_from=rank0 the ranks other than 0 build the model on the meta device, where "
                    "that state cannot be made; use strategy.init_from=every_rank, or an optimizer such as adamw")
        return super().refusal(feature, spec)

    def precision_note(self, precision: str) -> str:
        return self.policy_note(precision)

    def describe(self) -> str:
        built = "; built on rank 0, sent to the others" if self.init_from == "rank0" else ""
        return f"fsdp (FSDP2 fully_shard on a 1-D DeviceMesh: {self.describe_units()}{built})"

    def own_rows(self, spec: Any, run_dir: Any) -> list[tuple[str, str]]:
        """The memory row: this recipe's parameter, gradient and optimizer bytes per rank, against DDP's. None for a
        script: it builds its own model, and only its workers run it."""
        from launcher.strategies.impl.fsdp import memory_row  # builds the model on the meta device: torch

        return [] if spec.script is not None else [("memory", memory_row(spec, run_dir))]


__getattr__ = forward(__name__, FSDPSpec.impl)
