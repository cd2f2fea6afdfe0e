"""A user's own recipe, by name or by path: ``recipe=mine``, ``recipe=path/to/mine.py``, ``recipe=path/to/mine.yaml``.

``recipe=mine`` finds ``DIR/recipe/mine.yaml`` under a ``--config-dir DIR``; a value that ends in ``.py``,
``.yaml`` or ``.yml``, or holds a ``/``, is a file (relative to the current directory). Each is read here
(once per command), and stored in Hydra's ConfigStore as the option ``user/NAME`` in the ``recipe`` group, and the override
is rewritten to choose it. So the user's recipe *replaces* the default recipe (no keys merged in from
``recipe=linear``), its ``entry`` is relative to the YAML that names it, and its YAML needs no
``# @package _global_`` header: its first line can be the command that runs it.

    recipe/mine.yaml        recipe:
                              entry: ../mine.py     # relative to this YAML; or a module name
                              strategies: [one_device, mirrored]
"""

from __future__ import annotations

import re
from pathlib import Path
from collections.abc import Hashable
from typing import Any, Iterable

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from launcher.config.errors import ConfigError, Problem

GROUP = "user"  # the options live at recipe/user/NAME: no file a user writes is found first
SUFFIXES = (".py", ".yaml", ".yml")
OPTIONS: dict[str, Path] = {}  # option (user/NAME) -> the file it was read from
TYPED: dict[str, str] = {}  # option -> what a later command types to choose it: the --config-dir name, or the absolute path
YAMLS: dict[str, Path] = {}  # a user recipe's resolved entry -> the YAML its settings were read from (to name it in errors)


def is_path(value: str) -> bool:
    return value.endswith(SUFFIXES) or "/" in value


def config_dir_recipes(config_dirs: Iterable[str]) -> dict[str, Path]:
    """``NAME -> DIR/recipe/NAME.yaml`` for each ``--config-dir`` (the first directory wins)."""
    found: dict[str, Path] = {}
    for directory in config_dirs:
        for path in sorted(Path(directory, "recipe").glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def find(value: str, config_dirs: Iterable[str]) -> Path | None:
    """The file ``recipe=value`` names (None: a shipped recipe's name, or unknown); ConfigError for a missing file."""
    if not is_path(value):
        return config_dir_recipes(config_dirs).get(value)
    path = Path(value).expanduser()
    if not path.is_file():
        why = "is not a file" if path.exists() else "does not exist"
        raise ConfigError([Problem(key="recipe", value=value, message=f"recipe file {path.resolve()} {why}; a recipe is a "
                                   "shipped name (dlaunch recipes ls), DIR/recipe/NAME.yaml under --config-dir DIR, "
                                   "or a path to the recipe's .py or .yaml")])
    return path.resolve()


def node(path: Path, shipped: dict[str, Path]) -> DictConfig:
    """The recipe file as the config a run composes: ``recipe.name`` (the file's stem unless set) and ``entry`` resolved."""
    yaml_path = settings_of(path, shipped) if path.suffix == ".py" else path
    if path.suffix == ".py":
        data = _read_yaml(yaml_path) if yaml_path.is_file() else {"recipe": {}}
        data["recipe"]["entry"] = str(path)
    else:
        data = _read_yaml(path)
        data["recipe"]["entry"] = _entry(path, data["recipe"].get("entry"), shipped)
    if yaml_path.is_file() and path not in shipped.values():
        YAMLS[data["recipe"]["entry"]] = yaml_path
    data["recipe"].setdefault("name", path.stem)
    return OmegaConf.create(data)


def settings_of(py: Path, shipped: dict[str, Path]) -> Path:
    """The YAML of recipe module ``py``: ``mine.yaml`` beside it, else ``recipe/mine.yaml`` beside it where its entry
    is this module (what ``dlaunch recipes cp`` writes); the first, absent, where there is neither."""
    beside, copied = py.with_suffix(".yaml"), py.parent / "recipe" / f"{py.stem}.yaml"
    if beside.is_file() or not copied.is_file():
        return beside
    try:
        entry = _entry(copied, yaml.safe_load(copied.read_text())["recipe"]["entry"], shipped)
    except (OSError, yaml.YAMLError, TypeError, KeyError, ConfigError):
        return beside  # not that module's settings, or unreadable: `recipe=recipe/mine.yaml` shows why
    return copied if Path(entry).resolve() == py.resolve() else beside


class _NoDuplicates(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: yaml.safe_load kept the last one silently
    (a second `input:` section dropped the first), and OmegaConf's loader, which refuses it, raised a traceback."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # a complex key: the base loader says what is wrong with it
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice in one mapping (first at line {seen[key].line + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def yaml_problem(exc: OSError | yaml.YAMLError, path: Path | str | None = None) -> Problem:
    """A YAML file that cannot be read or parsed, named with the line and column of the fault."""
    mark = getattr(exc, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    why = getattr(exc, "problem", None) or getattr(exc, "strerror", None) or str(exc).splitlines()[0]
    name = path or getattr(mark, "name", None) or getattr(exc, "filename", None) or "a YAML file"
    return Problem(key=str(name), message=f"cannot read this YAML: {why}{at}", has_value=False)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(), Loader=_NoDuplicates)  # noqa: S506 - a SafeLoader
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError([yaml_problem(exc, path)]) from None
    if not isinstance(data, dict) or not isinstance(data.get("recipe"), dict):
        raise ConfigError([Problem(key=str(path), has_value=False, message="not a recipe config: it needs a top-level "
                                   "recipe: mapping with recipe.entry (as dlaunch recipes cp linear DIR/ writes)")])
    return data


def absolute_file(entry: str) -> str:
    """``recipe.entry``: a .py path made absolute from where dlaunch started, as workers get it (they may start in
    another directory: hydra.job.chdir=true); a module name as is."""
    return str(Path(entry).expanduser().absolute()) if entry.endswith(".py") else entry


def _entry(path: Path, entry: Any, shipped: dict[str, Path]) -> str:
    if path in shipped.values():  # a shipped YAML names no entry: its module sits beside it in the package
        return f"launcher.recipes.{path.stem}"
    if not entry:
        raise ConfigError([Problem(key="recipe.entry", has_value=False, message=f"required key is missing in {path}: "
                                   "the recipe's .py file (relative to this YAML, e.g. entry: ../mine.py) or a module name")])
    entry = str(entry)
    return str((path.parent / entry).resolve()) if entry.endswith(".py") and not Path(entry).is_absolute() else entry


def option_for(path: Path, shipped: dict[str, Path]) -> str:
    """Store the recipe at ``path`` under an option of its own (``user/STEM``, numbered if that stem is taken).

    The file is read again at each call (once per command), so a second command in the same process sees an edit.
    """
    option = next((known for known, source in OPTIONS.items() if source == path), None) or _free_option(path.stem)
    ConfigStore.instance().store(group=f"recipe/{GROUP}", name=option.split("/", 1)[1], node=node(path, shipped),
                                 package="_global_", provider="dlaunch user recipe")
    OPTIONS[option] = path
    return option


def _free_option(stem: str) -> str:
    option, n = f"{GROUP}/{stem}", 1
    while option in OPTIONS:
        n += 1
        option = f"{GROUP}/{stem}_{n}"
    return option


def rewrite(overrides: list[str], config_dirs: Iterable[str], shipped: dict[str, Path], default: str) -> list[str]:
    """``overrides`` with each user recipe (a ``--config-dir`` name or a path) chosen as its stored option.

    With no ``recipe=`` at all, a ``--config-dir`` copy of the default recipe is chosen as Hydra would choose it.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    config_dirs = list(config_dirs)
    out, chosen = [], False
    for text in overrides:
        try:
            parsed = OverridesParser.create().parse_overrides([text])[0] if text.partition("=")[0].strip() == "recipe" else None
        except Exception:  # noqa: BLE001 - compose.parse_overrides reports it with the others
            parsed = None
        if parsed is None or parsed.is_sweep_override() and not parsed.is_choice_sweep():
            out.append(text)
            continue
        chosen = True
        values = list(parsed.sweep_string_iterator()) if parsed.is_choice_sweep() else [str(parsed.value())]
        options = [_option(v, config_dirs, shipped) for v in values]
        out.append(f"recipe={','.join(options)}")
    if not chosen and default in config_dir_recipes(config_dirs):
        out.append(f"recipe={_option(default, config_dirs, shipped)}")
    return out


def _option(value: str, config_dirs: list[str], shipped: dict[str, Path]) -> str:
    path = find(value, config_dirs)
    if path is None:
        return value  # a shipped name, or unknown: check_group_choices says which
    if path in shipped.values():
        return path.stem
    option = option_for(path, shipped)
    TYPED[option] = _quoted(str(path)) if is_path(value) else value  # a path from any directory; a name with its --config-dir
    return option


def _quoted(value: str) -> str:
    """``value`` as one Hydra override value: quoted where it holds more than a plain path's characters."""
    if re.fullmatch(r"[\w./~+-]+", value):
        return value
    return "'" + value.replace("'", "\\'") + "'"


def as_typed(overrides: Iterable[str]) -> list[str]:
    """``overrides`` with each stored option (``recipe=user/NAME``) as the user would type it again.

    Hydra records a job's overrides as it got them (``.hydra/overrides.yaml``); ``dlaunch resume`` and
    the sweep table read that file, in another process, where ``user/NAME`` means nothing.
    """
    out = []
    for text in overrides:
        if _added_beside_a_script(text):
            continue
        key, eq, value = text.partition("=")
        out.append(f"{key}={TYPED[value]}" if eq and key == "recipe" and value in TYPED else text)
    return out


def as_shown(overrides: Iterable[str]) -> list[str]:
    """``overrides`` for a table or a chart's label, as the user typed them: without the ``+`` or ``++`` that dlaunch
    adds to a recipe key its YAML does not list and to a script's keys (``compose``), which is the same setting, and
    ``script.path=X`` (what ``script=X`` beside ``script.args`` becomes) as ``script=X``."""
    return [_shown(o) for o in overrides if not _added_beside_a_script(o)]


def _shown(override: str) -> str:
    bare = override.lstrip("+")
    if bare.startswith("script.path="):
        return "script=" + bare.partition("=")[2]
    return bare if bare.startswith(("recipe.", "script.")) else override


def _added_beside_a_script(override: str) -> bool:
    """``~recipe`` (Hydra records it as ``~recipe=null``): what compose adds beside ``script=``, and adds again when
    the command is read back; not the user's."""
    return override.partition("=")[0] == "~recipe"
