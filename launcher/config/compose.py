"""Compose the Hydra config and validate it into a ``RunSpec``, once, in the parent.

Errors come back as ``ConfigError``: the key path, the bad value, what is
allowed and a did-you-mean, never a traceback.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from pathlib import Path
from typing import Any, Iterable

import yaml

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher.config import shapes, task_overrides, user_recipes
from launcher.config.errors import ConfigError, Problem, RecipeBesideScript, did_you_mean
from launcher.config.overrides import key_of
from launcher.config.schema import ClusterSpec, RunSpec
from launcher.config.unknown_keys import unknown_key_problem
from launcher.config.validation import validate

CONF_DIR = Path(str(importlib.resources.files("launcher.conf")))
RECIPE_DIR = Path(str(importlib.resources.files("launcher.recipes")))
GENERATED_GROUPS = ("cluster", "recipe")
GROUPS = ("strategy", "cluster", "recipe")  # the config groups a command picks an option of
CONFIG_DIRS: list[str] = []  # `dlaunch --config-dir DIR`: searched first, as Hydra searches it for the run itself
CONFIG_NAME = "config"  # `dlaunch --config-name NAME`: the primary config (in a --config-dir, or dlaunch's own)
DEFAULT_RECIPE = "linear"


def file_options(group: str) -> list[str]:
    """A group's YAML files: dlaunch's own and those of each ``--config-dir`` (``DIR/strategy/NAME.yaml``), as Hydra
    finds them for the run."""
    dirs = [CONF_DIR, *(Path(d) for d in CONFIG_DIRS)]
    return sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})


def recipe_files() -> dict[str, Path]:
    return {p.stem: p.resolve() for p in sorted(RECIPE_DIR.glob("*.yaml"))}


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
    for name, path in recipe_files().items():
        _store("recipe", name, (str(path), path.stat().st_mtime_ns), package="_global_")
    for shape in shapes.named(overrides, CONFIG_DIRS, CONFIG_NAME):
        _store("cluster", shape, shape)


_STORED: dict[tuple[str, str], Any] = {}  # (group, name) -> what this process stored there last


def _store(group: str, name: str, source: Any, package: str | None = None) -> None:
    """Store an option once per process and source (ConfigStore copies each node it stores: 5 ms a recipe)."""
    store = ConfigStore.instance()
    if _STORED.get((group, name)) == source and f"{name}.yaml" in store.repo.get(group, {}):
        return
    if group == "recipe":
        node = _shipped_recipe(name, *source)
    else:
        node = shapes.node(name, ClusterSpec().model_dump())
    store.store(group=group, name=name, node=node, package=package, provider="dlaunch")
    _STORED[(group, name)] = source


@functools.lru_cache(maxsize=64)
def _shipped_recipe(name: str, path: str, mtime_ns: int) -> DictConfig:
    """A shipped recipe's YAML as a stored option, parsed once per process (per version of the file)."""
    node = OmegaConf.load(path)
    node.recipe.name = name
    node.recipe.entry = f"launcher.recipes.{name}"
    return node


def choose_user_recipes(overrides: list[str]) -> list[str]:
    """``overrides`` with ``recipe=NAME`` of a ``--config-dir`` and ``recipe=PATH`` chosen as stored options (user_recipes),
    ``recipe.KEY=V`` for a KEY the recipe's YAML leaves out as ``+recipe.KEY=V``, and ``script.KEY=V`` as ``++script.KEY=V``.

    A recipe's ``Config`` can have fields its YAML does not list (their defaults stand); Hydra knows only
    the YAML's keys. The ``Config`` still judges the key when the spec is validated: an unknown one is
    named there, with the ``Config``'s fields as what is allowed.
    """
    overrides = task_overrides.one_task(task_overrides.whole_task_lists(user_recipes.rewrite(overrides, CONFIG_DIRS, recipe_files(), DEFAULT_RECIPE)))
    # script.path=X, script.args=[...]: set or add, under the default `script: null` or a YAML's section alike
    overrides = [f"++{o}" if key_of(o).startswith("script.") and o[:1] not in "+~" else o for o in overrides]
    overrides = _script_without_recipe(overrides)
    keyed = [o for o in overrides if key_of(o).startswith("recipe.") and o[:1] not in "+~"]
    if not keyed:
        return overrides
    choice = [o for o in overrides if key_of(o) == "recipe"]
    try:
        if any(ov.is_sweep_override() for ov in parse_overrides(choice)):  # each job's recipe differs: set or add
            return [f"++{o}" if o in keyed else o for o in overrides]
        recipe = chosen_recipe(choice)
    except ConfigError:
        return overrides  # the choice's own problem is reported where it always was
    absent = object()  # not None: a key the YAML sets to null is there

    def added(key: str) -> bool:
        """A key the YAML lacks (``optimizer.lr`` where it has no ``optimizer`` section), under no value that is
        not a section; the recipe's Config then judges it, naming its own fields where it is a typo."""
        if OmegaConf.select(recipe, key, default=absent) is not absent:
            return False
        parent = key.rpartition(".")[0]
        while parent and OmegaConf.select(recipe, parent, default=absent) is absent:
            parent = parent.rpartition(".")[0]
        return not parent or isinstance(OmegaConf.select(recipe, parent), DictConfig)

    return [f"+{o}" if o in keyed and added(key_of(o).removeprefix("recipe.")) else o for o in overrides]


def chosen_recipe(choice: list[str]) -> DictConfig:
    """The ``recipe`` section that ``choice`` (no ``recipe=``, or one ``recipe=NAME``) composes to. A shipped recipe
    under dlaunch's own primary config is its YAML's section, parsed once per process: a sweep checks each job's
    keys against it, and composing it anew cost each job ~60 ms. A ``--config-dir`` or ``--config-name`` may change
    any recipe, so there it is composed."""
    name = choice[0].partition("=")[2].strip() if choice else DEFAULT_RECIPE
    path = recipe_files().get(name) if len(choice) <= 1 and not CONFIG_DIRS and CONFIG_NAME == "config" else None
    if path is None:
        return compose(choice).recipe
    return _shipped_recipe(name, str(path), path.stat().st_mtime_ns).recipe


def _script_without_recipe(overrides: list[str]) -> list[str]:
    """``script=PATH`` takes the recipe's place: the default recipe (its YAML's ``trainer.steps``, ``input`` batch) is
    not composed in (``~recipe``), so that the trainer keys a script is given are the ones the user set. A recipe
    chosen or set beside a script would do nothing: refused, named."""
    if "~recipe" in overrides:  # `dlaunch resume` of a script's run: its overrides have it
        return overrides
    scripted = any(key_of(o).partition(".")[0] == "script" and o[:1] != "~" and o.partition("=")[2] != "null"
                   for o in overrides)
    if not scripted and not _script_in_primary_config(overrides):
        return overrides
    recipe = [o for o in overrides if key_of(o).partition(".")[0] == "recipe"]
    if recipe:
        raise RecipeBesideScript([Problem(key=key_of(o), value=o.partition("=")[2], message="a script takes the "
                                          "recipe's place, so this would do nothing; drop it, or the script") for o in recipe],
                                 [o for o in overrides if o not in recipe])
    return [*overrides, "~recipe"]



def _script_in_primary_config(overrides: list[str]) -> bool:
    """A ``script`` that the user's own primary config (``--config-dir``, ``--config-name``) sets. dlaunch's own sets
    none, so it is not composed for this; a composition that fails is reported where it always was."""
    if not CONFIG_DIRS and CONFIG_NAME == "config" or any(key_of(o).partition(".")[0] == "script" for o in overrides):
        return False
    try:
        return OmegaConf.select(compose(overrides), "script", default=None) is not None
    except ConfigError:
        return False


def recipe_option(path: Path) -> str:
    """The ``recipe=`` choice that runs the recipe file at ``path`` (a shipped one keeps its name)."""
    path, shipped = path.resolve(), recipe_files()  # resolved, as user_recipes compares them
    return path.stem if path in shipped.values() else user_recipes.option_for(path, shipped)


UNPARSABLE = "cannot parse this override"


def parse_overrides(overrides: list[str]) -> list[Override]:
    """The parsed overrides, or a ``ConfigError`` naming each one that does not parse (keyed by its whole text)."""
    parser = OverridesParser.create()
    try:
        return parser.parse_overrides(overrides)
    except OverrideParseException:
        pass
    problems = []
    for text in overrides:
        try:
            parser.parse_overrides([text])
        except OverrideParseException as exc:
            first = exc.message.strip().splitlines()[0]
            script = f"script={text}" if text.endswith(".py") and "=" not in text else None
            problems.append(Problem(key=text, message=f"{UNPARSABLE}: {first}", has_value=False,
                                    suggestion=script or _quoted(parser, text)))
    raise ConfigError(problems)


def _quoted(parser: OverridesParser, text: str) -> str | None:
    """``key='value'`` where quoting the value makes the override parse (``trainer.checkpoint.dir=~/ck``: a ``~``
    Hydra reads as a deletion); None otherwise. On a shell, the whole override then goes in double quotes."""
    key, eq, value = text.partition("=")
    if not eq or not value or "'" in value:
        return None
    try:
        parser.parse_overrides([f"{key}='{value}'"])
    except OverrideParseException:
        return None
    return f"\"{key}='{value}'\""


def check_group_choices(parsed: list[Override]) -> None:
    """Unknown group options fail here, with the options listed and a did-you-mean."""
    problems = []
    for ov in parsed:
        group = ov.key_or_group
        if ov.is_delete() or group not in GROUPS:
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
        if shapes.SHAPE.match(value) and all(int(v) > 0 for v in shapes.SHAPE.match(value).groups()) or value in file_options("cluster"):
            return None
        files = ", ".join(file_options("cluster"))
        shape = re.sub(r"\s*[xX*×:]\s*", "x", value.strip())  # 1X2, 2*8, 2 x 8: the shape meant
        found = shapes.SHAPE.match(shape)
        meant = shape if shape != value and found and all(int(v) > 0 for v in found.groups()) else None
        return Problem(key="cluster", value=value, suggestion=meant,
                       message=f"cluster must be NxM: N nodes x M devices per node, both >= 1 (e.g. 1x2, 2x8), or one of: {files}")
    options = group_options(group)
    if value in options or group == "recipe" and value in user_recipes.OPTIONS:
        return None
    if group == "recipe":
        options = sorted({*options, *user_recipes.config_dir_recipes(CONFIG_DIRS)})
        where = f"DIR/recipe/{value}.yaml in --config-dir " + " or ".join(CONFIG_DIRS) if CONFIG_DIRS else "--config-dir DIR with DIR/recipe/NAME.yaml"
        inside = [d for d in CONFIG_DIRS if (Path(d) / f"{value}.yaml").is_file()]  # the recipe folder itself given
        hint = f"; {value}.yaml is in {inside[0]} itself: give its parent, --config-dir {Path(inside[0]).parent}" if inside else ""
        return Problem(key=group, value=value, allowed=tuple(options), suggestion=did_you_mean(value, options),
                       message=f"unknown recipe: not a shipped recipe, nor {where}, nor a path (recipe=path/to/mine.py or .yaml){hint}")
    return Problem(key=group, value=value, message=f"unknown {group}", allowed=tuple(options), suggestion=did_you_mean(value, options))


def compose(overrides: list[str]) -> DictConfig:
    """Compose ``conf/config.yaml`` with ``overrides`` (no sweep syntax)."""
    register_configs(overrides)
    parsed = parse_overrides(overrides)
    check_group_choices(parsed)
    try:
        return _compose(overrides)
    except MissingConfigException as exc:
        raise ConfigError([_missing_config(exc)]) from None
    except (ConfigCompositionException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain_composition(parsed, exc)) from None
    except yaml.YAMLError as exc:  # a user's own YAML (--config-dir) that does not parse
        raise ConfigError([user_recipes.yaml_problem(exc)]) from None


def _compose(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="dlaunch"):
        if CONFIG_DIRS:  # the pre-check must see a copied recipe (`dlaunch recipes cp`) as the run will
            loader = GlobalHydra.instance().config_loader()
            for directory in reversed(CONFIG_DIRS):
                loader.config_search_path.prepend("command-line", f"file://{directory}")
            loader.repository.initialize_sources(loader.config_search_path)
        return hydra_compose(CONFIG_NAME, overrides=overrides, return_hydra_config=return_hydra_config)


def _missing_config(exc: MissingConfigException) -> Problem:
    """A config Hydra did not find: a group's option, or an entry of the primary config's defaults list (named with
    that file and the configs there are)."""
    missing = exc.missing_cfg_file or ""
    if "/" in missing or not (CONFIG_DIRS or CONFIG_NAME != "config"):
        return Problem(key=missing.rsplit("/", 1)[0] if "/" in missing else missing, value=missing.rsplit("/", 1)[-1],
                       message="config not found", allowed=tuple(exc.options or ()))
    there = sorted({p.stem for d in [*CONFIG_DIRS, str(CONF_DIR)] for p in Path(d).glob("*.yaml")})
    return Problem(key=f"defaults of {CONFIG_NAME}.yaml", value=missing, allowed=tuple(there),
                   suggestion=did_you_mean(missing, there),
                   message=f"no {missing}.yaml in --config-dir or dlaunch's own configs (where Hydra looks)")


def _is_group_override(ov: Override) -> bool:
    return ov.key_or_group in GROUPS or "/" in ov.key_or_group


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
        cause = str(exc.__cause__ or "").strip()
        culprit = next((ov for ov in parsed if ov.input_line and ov.input_line in str(exc)), None)
        if culprit is None:
            problems.append(Problem(key="overrides", message=message + (f" ({cause.splitlines()[0]})" if cause else ""),
                                    has_value=False))
        else:  # a value Hydra's own config refuses (hydra.job.chdir=maybe): its words alone
            problems.append(Problem(key=culprit.key_or_group, value=_value_text(culprit),
                                    message=cause.splitlines()[0] if cause else message))
    return problems


def _value_text(ov: Override) -> Any:
    try:
        return ov.get_value_element_as_str()
    except Exception:  # noqa: BLE001 - only used for display
        return None


def compose_and_validate(overrides: list[str], cuda_devices: int) -> RunSpec:
    """The validated run spec; every problem found in one ``ConfigError``, unknown keys and the rest together."""
    try:
        cfg = compose(overrides)
    except ConfigError as exc:
        raise with_the_rest(exc, overrides, cuda_devices) from None
    return validate(cfg, cuda_devices)


def with_the_rest(exc: ConfigError, overrides: list[str], cuda_devices: int) -> ConfigError:
    """``exc`` (a composition that failed on overrides it names: unknown keys, values Hydra's own config refuses,
    group options unknown or refused) plus what the other overrides get wrong. Without a group's option, the keys
    under that group mean nothing: they are left out."""
    groups = {p.key for p in exc.problems if p.key in GROUPS and not p.message.startswith("unknown key")}
    named = {p.key for p in exc.problems if any(key_of(o) == p.key for o in overrides)} - groups
    unparsable = {p.key for p in exc.problems if p.message.startswith(UNPARSABLE)}  # keyed by the whole override
    rest = [o for o in overrides if o not in unparsable
            and (k := key_of(o)) not in named and k.split(".")[0] not in groups]
    unknown_option = any(p.key in groups and p.message.startswith("unknown") for p in exc.problems)
    try:
        if named | groups | unparsable and len(named | groups | unparsable) == len({p.key for p in exc.problems}) and rest != overrides:
            _check_the_rest(rest, cuda_devices)
    except ConfigError as more:  # the recipe's own code failing at import (UserCodeError) too: one screen names all
        # checked against a default in place of an unknown option, the groups' own rules would blame the default
        found = [p for p in more.problems if p not in exc.problems and not (unknown_option and p.key.split(".")[0] in GROUPS)]
        return ConfigError([*exc.problems, *found])
    return exc


def _check_the_rest(rest: list[str], cuda_devices: int) -> None:
    try:
        cfg = compose(rest)
    except ConfigError as exc:  # unknown keys now that the group options are gone: the rest of those too
        raise with_the_rest(exc, rest, cuda_devices) from None
    validate(cfg, cuda_devices, rest, found=True)


def primary_config_usable(config_path: str | None, config_name: str | None) -> None:
    """``--config-name`` is looked up as Hydra does (``--config-dir`` first); ``--config-path`` would drop dlaunch's own configs."""
    if config_path is not None:
        raise ConfigError([Problem(key="--config-path", value=config_path, message="would replace dlaunch's own "
                                   "configs (strategy, cluster, recipe groups); use --config-dir DIR, searched before "
                                   "them, with --config-name NAME for DIR/NAME.yaml")])
    missing = [d for d in CONFIG_DIRS if not Path(d).is_dir()]
    if missing:
        raise ConfigError([Problem(key="--config-dir", value=missing[0], message="no such directory: it should hold "
                                   "your config groups (DIR/recipe/NAME.yaml, DIR/strategy/NAME.yaml, ...)")])
    if config_name is None:
        return
    dirs = [*CONFIG_DIRS, str(CONF_DIR)]
    if not any(Path(d, f"{config_name.removesuffix('.yaml')}.yaml").is_file() for d in dirs):
        raise ConfigError([Problem(key="--config-name", value=config_name, message="no such primary config: looked "
                                   f"for {config_name.removesuffix('.yaml')}.yaml in {', '.join(dirs)} (add --config-dir DIR)")])
