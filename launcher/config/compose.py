"""Compose the Hydra config and validate it into a ``RunSpec``, once, in the parent.

Errors come back as ``ConfigError``: the key path, the bad value, what is
allowed and a did-you-mean, never a traceback.
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path
from typing import Any, Iterable

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError

from launcher.config import pydantic_errors
from launcher.config import script as script_config
from launcher.config.errors import ConfigError, Problem, did_you_mean
from launcher.config.schema import ClusterSpec, RunSpec
from launcher.runtime import recipe as recipe_lib

CONF_DIR = Path(str(importlib.resources.files("launcher.conf")))
RECIPE_DIR = Path(str(importlib.resources.files("launcher.recipes")))
SHAPE = re.compile(r"^(\d+)x(\d+)$")
GENERATED_GROUPS = ("cluster", "recipe")
CONFIG_DIRS: list[str] = []  # `dlaunch --config-dir DIR`: searched first, as Hydra searches it for the run itself


def file_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def recipe_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted(RECIPE_DIR.glob("*.yaml"))}


def group_options(group: str) -> list[str]:
    if group == "recipe":
        return sorted(recipe_files())
    if group == "cluster":
        return ["NxM (e.g. 1x1, 1x2, 2x8)", *file_options("cluster")]
    return file_options(group)


def register_configs(overrides: Iterable[str] = ()) -> None:
    """Put the recipes' YAMLs and the ``cluster=NxM`` shapes into Hydra's ConfigStore.

    Recipes keep their YAML beside their .py; cluster shapes are generated, so any
    ``NxM`` is an option without a file per shape.
    """
    store = ConfigStore.instance()
    overridden = {f.stem for d in CONFIG_DIRS for f in Path(d, "recipe").glob("*.yaml")}  # a user's copy wins
    for name, path in recipe_files().items():
        if name in overridden:
            continue
        node = OmegaConf.load(path)
        node.recipe.name = name
        node.recipe.entry = f"launcher.recipes.{name}"
        store.store(group="recipe", name=name, node=node, package="_global_", provider="dlaunch")
    for shape in {"1x1"} | _shapes_in(overrides):
        nodes, devices = (int(v) for v in SHAPE.match(shape).groups())
        node = {**ClusterSpec().model_dump(), "nodes": nodes, "devices_per_node": devices}
        store.store(group="cluster", name=shape, node=node, provider="dlaunch")


def _shapes_in(overrides: Iterable[str]) -> set[str]:
    shapes = set()
    for text in overrides:
        key, _, value = text.partition("=")
        if key.lstrip("+~") == "cluster":
            shapes |= {v for v in re.split(r"[,\s\[\]()]+", value) if SHAPE.match(v)}
    return shapes


def parse_overrides(overrides: list[str]) -> list[Override]:
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as exc:
        first = exc.message.strip().splitlines()[0]
        raise ConfigError([Problem(key=exc.override, message=f"cannot parse this override: {first}", has_value=False)]) from None


def check_group_choices(parsed: list[Override]) -> None:
    """Unknown group options fail here, with the options listed and a did-you-mean."""
    problems = []
    for ov in parsed:
        group = ov.key_or_group
        if ov.is_delete() or group not in ("strategy", "cluster", "recipe"):
            continue
        for value in _choices(ov):
            problem = _check_choice(group, value)
            if problem:
                problems.append(problem)
    if problems:
        raise ConfigError(problems)


def _choices(ov: Override) -> list[str]:
    if ov.is_choice_sweep():
        return list(ov.sweep_string_iterator())
    if ov.is_sweep_override():
        return []  # ranges and intervals are for sweepers; each job is validated on its own
    return [str(ov.value())]


def _check_choice(group: str, value: str) -> Problem | None:
    if group == "cluster":
        if SHAPE.match(value) and all(int(v) > 0 for v in SHAPE.match(value).groups()) or value in file_options("cluster"):
            return None
        files = ", ".join(file_options("cluster"))
        return Problem(key="cluster", value=value, message=f"cluster must be NxM: N nodes x M devices per node, both >= 1 (e.g. 1x2, 2x8), or one of: {files}")
    options = group_options(group)
    if value in options:
        return None
    return Problem(key=group, value=value, message=f"unknown {group}", allowed=tuple(options), suggestion=did_you_mean(value, options))


def compose(overrides: list[str]) -> DictConfig:
    """Compose ``conf/config.yaml`` with ``overrides`` (no sweep syntax)."""
    register_configs(overrides)
    parsed = parse_overrides(overrides)
    check_group_choices(parsed)
    try:
        return _compose(overrides)
    except MissingConfigException as exc:
        raise ConfigError([Problem(key=_group_of(exc.missing_cfg_file), value=exc.missing_cfg_file.rsplit("/", 1)[-1], message="config not found", allowed=tuple(exc.options or ()))]) from None
    except (ConfigCompositionException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain_composition(parsed, exc)) from None


def _compose(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="dlaunch"):
        if CONFIG_DIRS:  # the pre-check must see a copied recipe (`dlaunch recipes cp`) as the run will
            loader = GlobalHydra.instance().config_loader()
            for directory in reversed(CONFIG_DIRS):
                loader.config_search_path.prepend("command-line", f"file://{directory}")
            loader.repository.initialize_sources(loader.config_search_path)
        return hydra_compose("config", overrides=overrides, return_hydra_config=return_hydra_config)


def _group_of(missing: str) -> str:
    return missing.rsplit("/", 1)[0] if "/" in missing else missing


def _is_group_override(ov: Override) -> bool:
    return ov.key_or_group in ("strategy", "cluster", "recipe") or "/" in ov.key_or_group


def _explain_composition(parsed: list[Override], exc: Exception) -> list[Problem]:
    """Find which override names a key that does not exist, and suggest the nearest one."""
    groups = [ov.input_line for ov in parsed if _is_group_override(ov) and ov.input_line]
    try:
        base = _compose(groups, return_hydra_config=True)
    except Exception:  # noqa: BLE001 - fall back to Hydra's own words below
        base = None
    problems = []
    for ov in parsed:
        if base is None or _is_group_override(ov) or ov.is_add() or ov.is_force_add():
            continue
        problem = unknown_key_problem(base, ov.key_or_group, _value_text(ov))
        if problem:
            problems.append(problem)
    if not problems:
        lines = str(exc).strip().splitlines()
        message = lines[0] if lines else type(exc).__name__
        cause = exc.__cause__
        if cause is not None and str(cause).strip():
            message += f" ({str(cause).strip().splitlines()[0]})"
        culprit = next((ov.key_or_group for ov in parsed if ov.input_line and ov.input_line in str(exc)), "overrides")
        problems.append(Problem(key=culprit, message=message, has_value=False))
    return problems


def _value_text(ov: Override) -> Any:
    try:
        return ov.get_value_element_as_str()
    except Exception:  # noqa: BLE001 - only used for display
        return None


def unknown_key_problem(tree: DictConfig, dotted: str, value: Any) -> Problem | None:
    """None if ``dotted`` exists in ``tree``; otherwise a problem naming the nearest key."""
    parts = dotted.split(".")
    node: Any = tree
    for i, part in enumerate(parts):
        if isinstance(node, DictConfig) and part in node:
            node = node[part]
            continue
        siblings = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        prefix = ".".join(parts[:i])
        guess = did_you_mean(part, siblings)
        suggestion = ".".join([*parts[:i], guess, *parts[i + 1 :]]) if guess else None
        where = f" under {prefix}" if prefix else ""
        return Problem(
            key=dotted, value=value, message=f"unknown key{where}",
            allowed=tuple(s for s in siblings if s != "hydra"), suggestion=suggestion,
        )
    return None


def validate(cfg: DictConfig, cuda_devices: int) -> RunSpec:
    """The composed config as a ``RunSpec``, or a ``ConfigError`` listing every problem."""
    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise ConfigError([Problem(key=str(key), message=str(exc).splitlines()[0], has_value=False)]) from None
    data.pop("hydra", None)
    script_config.apply(data)
    try:
        # check_files: the parent looks at the input files once (workers need not)
        spec = RunSpec.model_validate(data, context={"cuda_devices": cuda_devices, "check_files": True})
    except ValidationError as exc:
        raise ConfigError(pydantic_errors.problems(exc, RunSpec, data)) from None
    if spec.script is None:  # a script is not imported here: it runs (once per worker) as __main__
        _validate_recipe(spec)
    return spec


def _validate_recipe(spec: RunSpec) -> None:
    recipe = spec.recipe.model_dump()
    try:
        loaded = recipe_lib.load(recipe)
    except recipe_lib.RecipeError as exc:
        raise ConfigError([Problem(key=exc.key, value=exc.value, message=exc.message)]) from None
    except ValidationError as exc:
        config_cls = recipe_lib.config_class(recipe_lib.import_entry(spec.recipe.entry), spec.recipe.entry)
        raise ConfigError(pydantic_errors.problems(exc, config_cls, recipe, prefix=("recipe",))) from None
    if loaded.manual:
        _manual_step_fits(spec)


def _manual_step_fits(spec: RunSpec) -> None:
    """A recipe whose train_step updates by itself (manual mode) owns backward and the update: dlaunch cannot add to them."""
    t = spec.trainer
    owned = [("trainer.precision", t.precision, t.precision == "fp16-mixed", "GradScaler must scale the loss before backward"),
             ("trainer.grad_accum_steps", t.grad_accum_steps, t.grad_accum_steps > 1, "micro-batches need dlaunch to call backward"),
             ("trainer.clip_grad_norm", t.clip_grad_norm, t.clip_grad_norm is not None, "clipping goes between backward and the update")]
    problems = [Problem(key=key, value=value, message=f"recipe {spec.recipe.name}'s train_step(model, batch, optimizer) does its "
                        f"own backward and update, so dlaunch cannot apply this ({why}); do it in the step, or drop the "
                        "optimizer argument so that dlaunch does backward and the update")
                for key, value, on, why in owned if on]
    if problems:
        raise ConfigError(problems)


def compose_and_validate(overrides: list[str], cuda_devices: int) -> RunSpec:
    return validate(compose(overrides), cuda_devices)
