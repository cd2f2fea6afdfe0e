"""``strategy=central_storage``: parameters once, compute replicated on threads of one process (``impl/central_storage.py``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from launcher.config.base import PlanError
from launcher.distribute.devices import canonical_name
from launcher.strategies import forward, unit
from launcher.strategies.base import Rule, StrategyUnit, no_tasks


@unit
class CentralStorageSpec(StrategyUnit):
    """``strategy=central_storage``: parameters stored once, compute replicated over devices of one process."""

    name: Literal["central_storage"]
    compute_devices: list[str] | None = Field(
        None, min_length=1, description="replica devices, e.g. [cpu:0,cpu:1] or [cuda:0,cuda:1]; null: one of the cluster's type",
    )
    parameter_device: str | None = Field(
        None, description="where parameters and optimizer state live; null: the only compute device, else cpu:0",
    )
    impl: ClassVar[str] = "launcher.strategies.impl.central_storage"
    exports: ClassVar[tuple[str, ...]] = ("CentralStorageStrategy",)
    refuses: ClassVar[dict[str, str]] = {
        "fp16-mixed": "its replicas are threads of one process that share one optimizer, and GradScaler's skipped "
                      "steps are per replica; use trainer.precision=bf16-mixed (no scaler needed)",
        "compile": "its replicas are threads of one process that run views of one module; torch.compile is not "
                   "made for that; use strategy=mirrored (one process per device) to compile",
        "activation_checkpointing": "its 2+ replicas are threads of one process that share the CPU's random generator, "
                                    "and a recomputed block restores that generator's state under the other replicas; "
                                    "use strategy=mirrored (one process per device)",
    }

    def replicas(self, cluster: Any) -> int:
        return len(self.compute_devices) if self.compute_devices else 1

    def refusal(self, feature: str, spec: Any) -> str | None:
        one_replica = self.replicas(spec.cluster) == 1  # no replica threads: the recompute has the RNG to itself
        return None if feature == "activation_checkpointing" and one_replica else self.refuses.get(feature)

    def describe(self) -> str:
        if not self.compute_devices:
            return f"central_storage (parameters on {self.parameter_device or 'the compute device'}, compute on the cluster's device)"
        # As CentralStorageStrategy: the only compute device, else the CPU.
        home = self.parameter_device or (self.compute_devices[0] if len(self.compute_devices) == 1 else "cpu:0")
        return f"central_storage (parameters once on {home}, compute on {', '.join(self.compute_devices)})"

    def own_rows(self, spec: Any, run_dir: Any) -> list[tuple[str, str]]:
        """Replica threads on the CPU draw from its one random generator, in the order the threads happen to run."""
        on_cpu = [d for d in self.compute_devices or [] if d.startswith("cpu")]
        if len(on_cpu) < 2:
            return []
        return [("random", f"its {len(on_cpu)} CPU replica threads share the CPU's random generator: a step that draws "
                           "random numbers (dropout) differs from run to run, and a resume is not bitwise; on GPUs each "
                           "replica draws from its own device's")]

    def shape_rules(self) -> tuple[Rule, ...]:
        return (no_tasks, one_process_shape)  # its one process covers one_replica_shape: one message, not two

    def named_devices(self) -> list[tuple[str, str]]:
        return [("strategy", d) for d in self.devices()]

    @field_validator("compute_devices")
    @classmethod
    def _known_devices(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        names = [canonical_name(v) for v in value]
        if len(set(names)) != len(names):
            raise ValueError(f"compute_devices must be distinct, got {names}")
        return names

    @field_validator("parameter_device")
    @classmethod
    def _known_device(cls, value: str | None) -> str | None:
        return None if value is None else canonical_name(value)

    def devices(self) -> list[str]:
        """Every device it names (to check they exist)."""
        return [*(self.compute_devices or []), *([self.parameter_device] if self.parameter_device else [])]


def one_process_shape(spec: Any, cuda: int) -> None:
    c = spec.cluster
    if c.world_size > 1:
        devices = ",".join(f"{spec.device_type(cuda)}:{i}" for i in range(c.devices_per_node))  # one machine's
        raise PlanError(
            "cluster", c.shape,
            f"strategy {spec.strategy.name} runs its {spec.num_replicas} replica(s) as threads of 1 process on 1 machine, "
            f"but cluster {c.shape} = {c.nodes} node(s) x {c.devices_per_node} device(s) = {c.world_size} processes; "
            f"list the devices in strategy.compute_devices instead, a replica thread each: "
            f"cluster=1x1 'strategy.compute_devices=[{devices}]'",
        )


__getattr__ = forward(__name__, CentralStorageSpec.impl)
