"""``OneDeviceStrategy``: everything on one device, one replica.

Example::

    strategy = OneDeviceStrategy("cuda:0")   # or "cpu:0"
    with strategy.scope():
        model = torch.nn.Linear(8, 1)        # created on cuda:0
"""

from __future__ import annotations

from typing import Any

import torch

from launcher.distribute import devices as devlib
from launcher.distribute.extended import StrategyExtended
from launcher.distribute.strategy import Strategy
from launcher.strategies import Runtime


class _OneDeviceExtended(StrategyExtended):
    def _prepare(self, module: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        return module.to(self._devices[0]), optimizer


class OneDeviceStrategy(Strategy):
    """A distribution strategy for running on a single device."""

    def __init__(self, device: str | torch.device):
        super().__init__(_OneDeviceExtended([devlib.canonical_name(device)]))


def from_spec(spec: Any, runtime: Runtime) -> OneDeviceStrategy:
    device = spec.device or ("cuda:0" if runtime.device_type == "cuda" else "cpu:0")
    if device.startswith("cuda"):  # what takes no device (a recipe's torch.cuda.max_memory_allocated()) means this one
        torch.cuda.set_device(device)
    return OneDeviceStrategy(device)
