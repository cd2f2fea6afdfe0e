"""Strategies, one unit per file, each registered under the name used in ``strategy=NAME``.

Every module of this package is a strategy unit (``base.StrategyUnit``): the
registry imports them all, so adding a strategy is its file here, its torch side
in ``impl/`` and its ``conf/strategy/NAME.yaml``. The registry lookup is the one
place that branches on a strategy's name.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
import typing
from typing import TYPE_CHECKING, Annotated, Any, Callable, Union

from pydantic import Field

from launcher.cluster.env import WorkerEnv

if TYPE_CHECKING:
    from launcher.distribute.strategy import Strategy
    from launcher.strategies.base import StrategyUnit

_NOT_UNITS = ("base",)  # modules of this package that define no strategy
_UNITS: dict[str, type["StrategyUnit"]] = {}


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What a worker knows when it builds its strategy from a validated spec."""

    env: WorkerEnv | None
    device_type: str  # "cpu" or "cuda", resolved by validation
    backend: str  # "gloo" or "nccl"
    collective_timeout_s: float = 300.0
    run_spec: Any = None  # the whole validated RunSpec (its cluster, trainer and launch settings)
    task: tuple[str, int] | None = None  # parameter_server: this process's task (type, index)


def unit(cls: type["StrategyUnit"]) -> type["StrategyUnit"]:
    """Class decorator: register a strategy's spec under the value of its ``name: Literal[...]``."""
    (name,) = typing.get_args(cls.model_fields["name"].annotation)
    _UNITS[name] = cls
    return cls


@functools.cache
def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        if not module.ispkg and module.name not in _NOT_UNITS:
            importlib.import_module(f"{__name__}.{module.name}")


def units() -> dict[str, type["StrategyUnit"]]:
    """Every strategy's spec model by name, sorted."""
    _discover()
    return dict(sorted(_UNITS.items()))


def available() -> list[str]:
    return list(units())


def spec_union() -> Any:
    """The run spec's ``strategy`` type: every unit's model, told apart by ``name``."""
    return Annotated[Union[tuple(units().values())], Field(discriminator="name")]


def lookup(name: str) -> type["StrategyUnit"]:
    try:
        return units()[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; available: {', '.join(available())}") from None


def build(spec: Any, runtime: Runtime) -> "Strategy":
    """Build the strategy ``spec`` (a validated unit) describes, for this worker; an unknown name lists the known ones.
    Its ``precision`` is the run's ``trainer.precision`` (``strategy.autocast()`` in a script's own loop), and
    ``prepare()`` applies ``trainer.activation_checkpointing``."""
    lookup(spec.name)
    strategy = spec.build(runtime)
    if runtime.run_spec is not None:
        strategy.precision = runtime.run_spec.trainer.precision
        strategy.activation_checkpointing = tuple(runtime.run_spec.trainer.activation_checkpointing)
    return strategy


def exported(name: str) -> str | None:
    """The module that defines public class ``name`` of some strategy (``launcher.distribute.MirroredStrategy``)."""
    return next((u.impl for u in units().values() if name in u.exports), None)


def exports() -> list[str]:
    """Every strategy's public class names."""
    return sorted(name for u in units().values() for name in u.exports)


def forward(module_name: str, impl: str) -> Callable[[str], Any]:
    """A unit module's ``__getattr__``: its torch side's names, imported on first use."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return getattr(importlib.import_module(impl), name)

    return __getattr__
