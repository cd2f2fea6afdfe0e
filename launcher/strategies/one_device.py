"""``strategy=one_device``: one replica on one device (``OneDeviceStrategy``, in ``impl/one_device.py``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from launcher.distribute.devices import canonical_name
from launcher.strategies import forward, unit
from launcher.strategies.base import Rule, StrategyUnit, no_tasks, one_replica_shape


@unit
class OneDeviceSpec(StrategyUnit):
    """``strategy=one_device``: one replica on one device."""

    name: Literal["one_device"]
    device: str | None = Field(None, description="e.g. cpu:0 or cuda:1; default: the cluster's device type, index 0")
    impl: ClassVar[str] = "launcher.strategies.impl.one_device"
    exports: ClassVar[tuple[str, ...]] = ("OneDeviceStrategy",)

    def replicas(self, cluster: Any) -> int:
        return 1

    def describe(self) -> str:
        return "one_device" + (f" on {self.device}" if self.device else "")

    def shape_rules(self) -> tuple[Rule, ...]:
        return (no_tasks, one_replica_shape)

    def named_devices(self) -> list[tuple[str, str]]:
        return [("strategy.device", self.device)] if self.device else []

    def plan_rows(self, rows: Any) -> list[tuple[str, str]]:
        standard = rows.standard()
        return [(k, self.device) if k == "devices" and self.device else (k, v) for k, v in standard]

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str | None) -> str | None:
        return None if value is None else canonical_name(value)


__getattr__ = forward(__name__, OneDeviceSpec.impl)
