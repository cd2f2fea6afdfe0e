"""Strategies, one per file, each registered under the name used in ``strategy=NAME``.

The registry lookup is the one place that branches on a strategy's name.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, Callable

from launcher.cluster.env import WorkerEnv

if TYPE_CHECKING:
    from launcher.distribute.strategy import Strategy

_BUILTIN = ("one_device", "mirrored", "multi_worker_mirrored", "central_storage", "parameter_server", "mesh", "fsdp")
_REGISTRY: dict[str, Callable[[Any, "Runtime"], "Strategy"]] = {}


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What a worker knows when it builds its strategy from a validated spec."""

    env: WorkerEnv | None
    device_type: str  # "cpu" or "cuda", resolved by validation
    backend: str  # "gloo" or "nccl"
    collective_timeout_s: float = 300.0
    run_spec: Any = None  # the whole validated RunSpec (parameter_server reads the cluster's tasks)
    task: tuple[str, int] | None = None  # parameter_server: this process's task (type, index)


def register(name: str) -> Callable[[Callable], Callable]:
    """Register ``builder(spec, runtime) -> Strategy`` under ``name``."""

    def deco(builder: Callable) -> Callable:
        _REGISTRY[name] = builder
        return builder

    return deco


def _load_builtins() -> None:
    for name in _BUILTIN:
        importlib.import_module(f"launcher.strategies.{name}")


def available() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def build(spec: Any, runtime: Runtime) -> "Strategy":
    """Build the strategy named by ``spec.name`` for this worker."""
    _load_builtins()
    try:
        builder = _REGISTRY[spec.name]
    except KeyError:
        raise KeyError(f"unknown strategy {spec.name!r}; available: {', '.join(available())}") from None
    return builder(spec, runtime)
