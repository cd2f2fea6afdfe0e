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
import inspect
import logging
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from launcher.runtime.recipe_import import RecipeError, import_entry, one_line, where_raised

if TYPE_CHECKING:  # validating a config imports this module: torch only where a recipe is built
    import torch


class RecipeConfig(BaseModel):
    """Base of a recipe's ``Config``: the keys every recipe has. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    name: str
    entry: str
    strategies: list[str] = Field(default_factory=list)


class OptimizerConfig(BaseModel):
    """``recipe.optimizer``: one optimizer, built by ``cfg.optimizer.build(model.parameters())``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    name: Literal["sgd", "adam", "adamw", "adagrad"] = Field("sgd", description="the torch.optim class")
    lr: float = Field(0.01, gt=0, description="learning rate (trainer.lr_schedule scales it per step)")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd only: momentum")
    weight_decay: float = Field(0.0, ge=0, description="L2 penalty (decoupled for adamw)")
    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field(
        default_factory=lambda: [0.9, 0.999], min_length=2, max_length=2, description="adam/adamw only (the others ignore it): the moments' decays")
    eps: float | None = Field(None, gt=0, description="adam/adamw/adagrad (sgd ignores it): the denominator's term; null: torch's default")
    implementation: Literal["auto", "for_loop", "foreach", "fused"] = Field(
        "auto", description="torch.optim's kernels; auto: fused for adam/adamw where the parameters train on CUDA, "
        "torch's own choice elsewhere")

    def build(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> torch.optim.Optimizer:
        """The optimizer over ``params``: parameters, or torch's parameter groups (``[{"params": [...],
        "weight_decay": 0.0}, ...]``, whose keys override these settings for that group)."""
        import torch

        params = list(params)
        kernels = self.kernels(params)
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay, **kernels)
        eps = {} if self.eps is None else {"eps": self.eps}
        if self.name == "adagrad":
            return torch.optim.Adagrad(params, lr=self.lr, weight_decay=self.weight_decay, **eps, **kernels)
        cls = torch.optim.Adam if self.name == "adam" else torch.optim.AdamW
        return cls(params, lr=self.lr, weight_decay=self.weight_decay, betas=tuple(self.betas), **eps, **kernels)

    def kernels(self, params: list[Any]) -> dict[str, bool]:
        """torch.optim's ``foreach``/``fused`` arguments. ``auto`` picks fused Adam(W) where the parameters will
        train on CUDA (in ``scope()`` they are built on the CPU and moved when it closes: the scope's device
        decides): one kernel per step for all of them, where foreach launches several per parameter group."""
        if self.implementation != "auto":
            return {"fused": True} if self.implementation == "fused" else {"foreach": self.implementation == "foreach"}
        from launcher.distribute import placement

        first = next((p for p in params if not isinstance(p, dict)), None)
        device = placement.target() or (first.device if first is not None else None)
        return {"fused": True} if device is not None and device.type == "cuda" and self.name in ("adam", "adamw") else {}


@dataclasses.dataclass
class Parts:
    """What ``build`` returns.

    ``train_data`` is a map-style ``torch.utils.data.Dataset`` (dlaunch batches,
    shuffles and splits it), the ``FileDataset`` of ``ctx.input_files`` (dlaunch
    shards it across workers), an iterable of global batches, or a function of an ``InputContext`` returning this
    worker's iterable of per-replica batches (``launcher/runtime/train_input.py``). ``objects``: the recipe's own state that a resume
    must find as it was (an EMA copy, a scheduler its ``train_step`` steps; not the data's position, which dlaunch keeps): anything with
    ``state_dict()`` and ``load_state_dict()`` whose state is tensors and plain data, by name; every checkpoint
    saves each rank's, and a resume restores it (``launcher/checkpoint/objects.py``).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_data: Any
    eval_data: Any = None
    objects: dict[str, Any] = dataclasses.field(default_factory=dict)


class RecipeContractError(TypeError):
    """The recipe's ``build`` or ``evaluate`` returned something dlaunch cannot use."""

    explained = True  # the message names the function, its file and what it must return


def checked_parts(parts: Any, build: Any) -> Parts:
    """What ``build`` returned, if it is ``Parts``."""
    if isinstance(parts, Parts):
        from launcher.checkpoint.objects import named

        try:
            named(parts.objects)
        except (TypeError, ValueError) as exc:
            raise RecipeContractError(f"the recipe's build() ({where(build)}) returned Parts with {exc}") from None
        return parts
    raise RecipeContractError(f"the recipe's build() ({where(build)}) returned {described(parts)}; it must return "
                              "launcher.runtime.recipe.Parts(model=..., optimizer=..., train_data=...)")


def checked_metrics(found: Any, evaluate: Any) -> dict[str, float]:
    """What ``evaluate`` returned, as names to floats; anything else named, with the function's file."""
    head = f"the recipe's evaluate() ({where(evaluate)}) returned"
    if not isinstance(found, dict):
        raise RecipeContractError(f"{head} {described(found)}; it must return a dict of names to numbers, "
                                  'e.g. {"eval_loss": loss.item()}')
    out = {}
    for key, value in found.items():
        try:
            if isinstance(value, (str, bytes)):  # float("0.27") would hide the recipe's bug
                raise TypeError(value)
            out[str(key)] = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise RecipeContractError(f"{head} {described(value, returned=False)} for {key!r}; each value must be a "
                                      "number (a float, or a tensor of one element)") from None
    return out


def where(fn: Any) -> str:
    """``path/to/recipe.py:12``: where a function of the user's is defined (its name, where the source is unknown)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else getattr(fn, "__qualname__", repr(fn))


def described(value: Any, returned: bool = True, forgot: str = "return") -> str:
    """``a tuple``, ``an int``, ``a tensor of shape (3,)``; ``None`` (with a hint where a function returned it:
    did it forget ``forgot``?)."""
    if value is None:
        return f"None (did it forget `{forgot}`?)" if returned else "None"
    if type(value).__module__.startswith("torch") and hasattr(value, "shape"):
        return f"a tensor of shape {tuple(value.shape)}"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What ``build`` may want to know about the run.

    ``input_files`` is the ``FileDataset`` that ``input.files`` describes (already
    batched by ``input.global_batch_size`` and shuffled by ``input.seed``), or None
    when no files are set. A recipe that returns it as ``train_data`` gets it
    sharded across workers by ``input.auto_shard_policy``; ``.select("x", "y")``
    makes its batches tuples instead of dicts.

    ``strategy`` is the run's strategy; None where ``build`` runs only to learn the model's variables (a
    parameter-server job's plan, in the parent, and its ps tasks).
    """

    strategy: Any
    seed: int
    global_batch_size: int
    per_replica_batch_size: int
    num_replicas_in_sync: int
    run_dir: Path
    is_chief: bool
    input_files: Any = None

    def colocate_vars_with(self, variable: Any) -> Any:
        """``strategy.extended.colocate_vars_with(variable)``, also where ``strategy`` is None: a parameter-server
        job's plan and ps tasks build the model to place its variables, and must place them as the chief does."""
        if self.strategy is not None:
            return self.strategy.extended.colocate_vars_with(variable)
        from launcher.distribute.placement import Placement

        return Placement(variable.device, colocate_with=variable)


def warn_if_files_unused(parts: "Parts", ctx: BuildContext, recipe: str) -> None:
    """``input.files`` set, but ``build`` returned other ``train_data``: the run would train on the recipe's own data
    while the plan lists the files (rank 0 says so once)."""
    from launcher.input.files import FileDataset

    from launcher.runtime.train_input import is_per_worker

    own = not isinstance(parts.train_data, FileDataset) and not is_per_worker(parts.train_data)  # a function may read them
    if ctx.input_files is not None and ctx.is_chief and own:
        logging.getLogger("dlaunch").warning(
            "input.files is set, but recipe %s's build() returned train_data of its own (%s), not ctx.input_files: "
            "dlaunch neither reads nor shards the files, and the recipe trains on that data", recipe,
            type(parts.train_data).__name__)


@dataclasses.dataclass(frozen=True)
class LoadedRecipe:
    module: ModuleType
    config: RecipeConfig
    manual: bool  # train_step takes the optimizer and updates by itself

    def evaluate(self) -> Any:
        return getattr(self.module, "evaluate", None)


def config_class(module: ModuleType, entry: str) -> type[RecipeConfig]:
    """The recipe's ``Config`` model (``RecipeConfig`` when it declares none); its functions are checked first."""
    for fn in ("build", "train_step"):
        if not callable(getattr(module, fn, None)):
            raise RecipeError(
                "recipe.entry", entry,
                f"recipe module {entry} has no function {fn}(); a recipe defines build(cfg, ctx) and train_step(model, batch)",
            )
    _takes(module.build, "build must take (cfg, ctx)", entry)
    if getattr(module, "evaluate", None) is not None:
        _takes(module.evaluate, "evaluate, when defined, must be a function of (model, parts)", entry)
    cls = getattr(module, "Config", RecipeConfig)
    if not (isinstance(cls, type) and issubclass(cls, RecipeConfig)):
        raise RecipeError("recipe.entry", entry, "the recipe's Config must subclass launcher.runtime.recipe.RecipeConfig")
    return cls


def _takes(fn: Any, message: str, entry: str) -> None:
    """``fn`` is a function that can be called with two positional arguments."""
    try:
        inspect.signature(fn).bind(None, None)
    except (TypeError, ValueError):
        given = f"it is {getattr(fn, '__name__', 'a callable')}{_signature(fn)}" if callable(fn) else f"it is a {type(fn).__name__}"
        raise RecipeError("recipe.entry", entry, f"{message}; {given}") from None


def _signature(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def load(recipe: dict[str, Any]) -> LoadedRecipe:
    """Import the recipe, check its functions and validate its config section.

    Raises ``RecipeError`` for a missing module or function and pydantic's
    ``ValidationError`` (locations relative to ``recipe``) for bad settings.
    """
    entry = recipe.get("entry", "")
    module = import_entry(entry)
    cls = config_class(module, entry)
    manual = _is_manual(module.train_step, entry)
    try:
        config = cls.model_validate(with_section_defaults(cls, recipe))
    except (ValidationError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - a validator of the recipe's Config failed by itself
        raise RecipeError("recipe", entry, f"the recipe's Config raised {one_line(exc)}{where_raised(exc)}") from None
    return LoadedRecipe(module=module, config=config, manual=manual)


def as_read(section: dict[str, Any]) -> dict[str, Any]:
    """A recipe section as its ``Config`` reads it, the defaults its YAML leaves out included (what ran); as given
    where it cannot be read (a recipe whose code changed since)."""
    try:
        return {**section, **load(section).config.model_dump(mode="json")}
    except Exception:  # noqa: BLE001 - the section as given is still a faithful record
        return dict(section)


def with_section_defaults(cls: type[BaseModel], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with each section (a field whose default is a model: ``optimizer``) laid over that default's
    values, not the section class's: ``optimizer: {lr: 0.1}`` keeps the recipe's ``momentum=0.9``, as a YAML
    listing the whole section would."""
    out = dict(given)
    for name, field in cls.model_fields.items():
        if isinstance(field.default, BaseModel) and isinstance(given.get(name), dict):
            out[name] = _merged(field.default.model_dump(), given[name])
    return out


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    return {**base, **{k: _merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                       for k, v in over.items()}}


def _is_manual(step: Any, entry: str) -> bool:
    try:
        parameters = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):
        parameters = []
    params = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) not in (2, 3):
        raise RecipeError(
            "recipe.entry", entry,
            f"train_step must take (model, batch) in simple mode or (model, batch, optimizer) in manual mode; "
            f"it takes {_signature(step)}",
        )
    return len(params) == 3
