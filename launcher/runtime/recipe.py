"""The recipe contract.

A recipe is one Python module plus its YAML. The module defines:

* ``class Config(RecipeConfig)``: the recipe's settings (the YAML's ``recipe:`` section),
  validated strictly;
* ``build(cfg, ctx) -> Parts``: model, optimizer and data, called inside
  ``strategy.scope()``;
* ``train_step(model, batch)``: returns the loss; dlaunch does backward and the
  update (simple mode). Or ``train_step(model, batch, optimizer)``: the step does
  its own ``backward()`` / ``optimizer.step()`` and returns the loss (manual mode);
* optionally ``evaluate(model, parts) -> dict[str, float]``, run once at the end.

The same functions run unchanged under every strategy: ``model`` and
``optimizer`` are what the strategy prepared (a DDP module, mirrored copies, or
the plain module).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class RecipeConfig(BaseModel):
    """Base of a recipe's ``Config``: the keys every recipe has. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    name: str
    entry: str
    strategies: list[str] = Field(default_factory=list)


class OptimizerConfig(BaseModel):
    """``recipe.optimizer``: one optimizer, built by ``cfg.optimizer.build(model.parameters())``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        cls = torch.optim.Adam if self.name == "adam" else torch.optim.AdamW
        return cls(params, lr=self.lr, weight_decay=self.weight_decay)


@dataclasses.dataclass
class Parts:
    """What ``build`` returns.

    ``train_data`` is a map-style ``torch.utils.data.Dataset`` (dlaunch batches,
    shuffles and splits it), the ``FileDataset`` of ``ctx.input_files`` (dlaunch
    shards it across workers), or an iterable of global batches.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_data: Any
    eval_data: Any = None


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What ``build`` may want to know about the run.

    ``input_files`` is the ``FileDataset`` that ``input.files`` describes (already
    batched by ``input.global_batch_size`` and shuffled by ``input.seed``), or None
    when no files are set. A recipe that returns it as ``train_data`` gets it
    sharded across workers by ``input.auto_shard_policy``; ``.select("x", "y")``
    makes its batches tuples instead of dicts.
    """

    strategy: Any
    seed: int
    global_batch_size: int
    per_replica_batch_size: int
    num_replicas_in_sync: int
    run_dir: Path
    is_chief: bool
    input_files: Any = None


class RecipeError(Exception):
    """The recipe cannot be loaded; ``key`` names the config key at fault."""

    def __init__(self, key: str, value: Any, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.value, self.message = key, value, message


@dataclasses.dataclass(frozen=True)
class LoadedRecipe:
    module: ModuleType
    config: RecipeConfig
    manual: bool  # train_step takes the optimizer and updates by itself

    def evaluate(self) -> Any:
        return getattr(self.module, "evaluate", None)


def import_entry(entry: str) -> ModuleType:
    """Import a recipe by module name (``launcher.recipes.linear``) or by file path."""
    if entry.endswith(".py"):
        path = Path(entry)
        if not path.is_file():
            raise RecipeError("recipe.entry", entry, f"recipe file {entry} does not exist")
        name = f"dlaunch_recipe_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(entry)
    except ModuleNotFoundError as exc:
        raise RecipeError("recipe.entry", entry, f"cannot import recipe module {entry}: {exc}") from None


def config_class(module: ModuleType, entry: str) -> type[RecipeConfig]:
    """The recipe's ``Config`` model (``RecipeConfig`` when it declares none)."""
    for fn in ("build", "train_step"):
        if not callable(getattr(module, fn, None)):
            raise RecipeError(
                "recipe.entry", entry,
                f"recipe module {entry} has no function {fn}(); a recipe defines build(cfg, ctx) and train_step(model, batch)",
            )
    cls = getattr(module, "Config", RecipeConfig)
    if not (isinstance(cls, type) and issubclass(cls, RecipeConfig)):
        raise RecipeError("recipe.entry", entry, "the recipe's Config must subclass launcher.runtime.recipe.RecipeConfig")
    return cls


def load(recipe: dict[str, Any]) -> LoadedRecipe:
    """Import the recipe, check its functions and validate its config section.

    Raises ``RecipeError`` for a missing module or function and pydantic's
    ``ValidationError`` (locations relative to ``recipe``) for bad settings.
    """
    entry = recipe.get("entry", "")
    module = import_entry(entry)
    config = config_class(module, entry).model_validate(recipe)
    return LoadedRecipe(module=module, config=config, manual=_is_manual(module.train_step, entry))


def _is_manual(step: Any, entry: str) -> bool:
    params = [
        p for p in inspect.signature(step).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(params) not in (2, 3):
        raise RecipeError(
            "recipe.entry", entry,
            "train_step must take (model, batch) in simple mode or (model, batch, optimizer) in manual mode",
        )
    return len(params) == 3
