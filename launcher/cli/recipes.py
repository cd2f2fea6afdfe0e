"""``dlaunch recipes``: list the shipped recipes, copy one to edit, check a recipe config.

    dlaunch recipes ls                              # name, strategies, purpose, command of each recipe
    dlaunch recipes cp linear my_recipes/           # my_recipes/linear.py + my_recipes/recipe/linear.yaml
    dlaunch --config-dir my_recipes recipe=linear   # runs the copy (cp prints this line); edits take effect
    dlaunch recipes validate my_recipes/            # compose + validate it under every strategy it declares

A copy runs from its own directory: its YAML's ``recipe.entry`` is the copied
``.py`` file, so edits to either take effect without touching the installed
package. Exit codes: 0 done, 2 refused or invalid.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.resources
import json
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from launcher.config.errors import ConfigError, Problem, did_you_mean, render

# The cluster shape each strategy is checked with: one that exercises it (several replicas where it has them).
STRATEGY_SHAPES: dict[str, tuple[str, ...]] = {
    "one_device": ("cluster=1x1",),
    "mirrored": ("cluster=1x2",),
    "multi_worker_mirrored": ("cluster=1x2",),
    "central_storage": ("cluster=1x1",),
    "parameter_server": ("cluster.workers=2", "cluster.ps=2"),
    "mesh": ("cluster=1x4",),
    "fsdp": ("cluster=1x2",),
}
PACKAGE_HEADER = "# @package _global_"
_VALIDATING = "_dlaunch_recipes_validate_"  # ConfigStore option under which a user's YAML is composed


class Refused(Exception):
    """A request that cannot be done: one line for the user, exit 2."""


def shipped() -> dict[str, Path]:
    """The shipped recipes' YAMLs by name: what ``launcher.config.compose.recipe_files()`` returns, without importing torch."""
    root = Path(str(importlib.resources.files("launcher.recipes")))
    return {p.stem: p for p in sorted(root.glob("*.yaml"))}


# ----- ls -----

@dataclasses.dataclass(frozen=True)
class RecipeInfo:
    name: str
    strategies: tuple[str, ...]
    purpose: str
    command: str


def describe(name: str, yaml_path: Path) -> RecipeInfo:
    """What ``ls`` shows of one recipe, read from its files (the module is parsed, never imported)."""
    text = yaml_path.read_text()
    try:
        data = yaml.safe_load(text) or {}
        strategies = tuple(str(s) for s in (data.get("recipe") or {}).get("strategies") or ())
    except (yaml.YAMLError, AttributeError):
        strategies = ("?",)
    return RecipeInfo(name=name, strategies=strategies, purpose=_purpose(yaml_path.with_suffix(".py")), command=_command(text, name))


def _purpose(py: Path) -> str:
    """The first line of the module's docstring."""
    try:
        doc = ast.get_docstring(ast.parse(py.read_text(), filename=str(py))) or ""
    except (OSError, SyntaxError, ValueError):
        return ""
    return next((line.strip() for line in doc.splitlines() if line.strip()), "")


def _command(yaml_text: str, name: str) -> str:
    """The YAML's first comment line (the command that runs the recipe), without ``# ``."""
    for line in yaml_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and not re.match(r"^#\s*@", stripped):
            command = stripped.lstrip("#").strip()
            if command:
                return command
        elif stripped and not stripped.startswith("#"):
            break
    return f"dlaunch recipe={name}"


def cmd_ls(args: argparse.Namespace, out: Console) -> int:
    table = Table(title="dlaunch recipes", title_justify="left", show_lines=False)
    table.add_column("recipe", style="bold", no_wrap=True)
    table.add_column("strategies", max_width=24, overflow="fold")  # wraps at the commas, not within a name, where it can
    table.add_column("purpose", overflow="fold")
    table.add_column("command", overflow="fold")  # folded, never cut short: it is to be copied
    for name, path in shipped().items():
        info = describe(name, path)
        table.add_row(escape(info.name), escape(", ".join(info.strategies)), escape(info.purpose), escape(info.command))
    out.print(table)
    out.print("Copy one to edit it: dlaunch recipes cp NAME DIR; check a config: dlaunch recipes validate PATH")
    return 0


# ----- cp -----

def run_command(name: str, directory: Path, shipped_command: str) -> str:
    """The shell command that runs the copy in ``directory``: the shipped command, with ``--config-dir`` searched first."""
    try:
        words = shlex.split(shipped_command)
    except ValueError:
        words = []
    if words[:1] != ["dlaunch"]:
        words = ["dlaunch"]
    rest = [w for w in words[1:] if not w.startswith(("recipe=", "hydra.searchpath="))]
    return shlex.join(["dlaunch", "--config-dir", str(directory), f"recipe={name}", *rest])


def copied_yaml(source: Path, name: str, py: Path, command: str, directory: Path) -> str:
    """The shipped YAML, its comments kept, with ``recipe.name`` and ``recipe.entry`` (the copied .py) set.

    ``# @package _global_`` must be the first line: Hydra reads a file's header only up to its first other line.
    """
    lines = source.read_text().splitlines()
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("#") and _is_header_or_command(lines[0])):
        lines.pop(0)
    head = [
        PACKAGE_HEADER,
        f"# {command}",
        f"# A copy of dlaunch's recipe {name}: recipe.entry runs {py}, so edits there take effect.",
        f"# Check it: dlaunch recipes validate {shlex.quote(str(directory))}",
    ]
    body = _with_name_and_entry(lines, name, str(py))
    text = "\n".join([*head, *body]) + "\n"
    if _loads_as(text, source, name, str(py)):
        return text
    # A layout the line edit cannot handle (flow style, anchors...): write the data, without the comments.
    data = yaml.safe_load(source.read_text()) or {}
    data.setdefault("recipe", {})
    data["recipe"] = {"name": name, "entry": str(py), **{k: v for k, v in data["recipe"].items() if k not in ("name", "entry")}}
    return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False)


def _is_header_or_command(line: str) -> bool:
    text = line.strip().lstrip("#").strip()
    return text.startswith("@") or text.startswith("dlaunch ")


def _with_name_and_entry(lines: list[str], name: str, entry: str) -> list[str]:
    """``lines`` with ``name:`` and ``entry:`` first under the top-level ``recipe:`` key (any earlier ones dropped)."""
    start = next((i for i, line in enumerate(lines) if re.match(r"^recipe:\s*(#.*)?$", line)), None)
    if start is None:
        return [*lines, "recipe:", f"  name: {name}", f"  entry: {json.dumps(entry)}"]
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith((" ", "\t", "#"))):
        end += 1
    block = lines[start + 1 : end]
    indent = next((re.match(r"^\s*", line).group(0) for line in block if line.strip() and not line.lstrip().startswith("#")), "  ")
    kept = [line for line in block if not re.match(rf"^{re.escape(indent)}(name|entry)\s*:", line)]
    return [*lines[: start + 1], f"{indent}name: {name}", f"{indent}entry: {json.dumps(entry)}", *kept, *lines[end:]]


def _loads_as(text: str, source: Path, name: str, entry: str) -> bool:
    """``text`` holds the source's data with only recipe.name and recipe.entry set."""
    try:
        new, old = yaml.safe_load(text), yaml.safe_load(source.read_text())
    except yaml.YAMLError:
        return False
    if not isinstance(new, dict) or not isinstance(old, dict) or not isinstance(new.get("recipe"), dict):
        return False
    old = {**old, "recipe": {**(old.get("recipe") or {}), "name": name, "entry": entry}}
    return new == old


def cmd_cp(args: argparse.Namespace, out: Console) -> int:
    recipes = shipped()
    name = args.name
    if name not in recipes:
        guess = did_you_mean(name, recipes)
        hint = f"; did you mean {guess}?" if guess else ""
        raise Refused(f"unknown recipe {name!r}{hint} (available: {', '.join(recipes)})")
    directory = Path(args.dest).expanduser().resolve()
    if directory.exists() and not directory.is_dir():
        raise Refused(f"{directory} exists and is not a directory")
    py, config = directory / f"{name}.py", directory / "recipe" / f"{name}.yaml"
    source = recipes[name]
    if py.resolve() == source.with_suffix(".py").resolve():
        raise Refused(f"{directory} is where dlaunch's own recipe {name} lives; copy it to another directory")
    existing = [p for p in (py, config) if p.exists() or p.is_symlink()]
    if any(p.is_dir() for p in existing):
        raise Refused(f"{next(p for p in existing if p.is_dir())} is a directory; cannot copy the recipe over it")
    if existing and not args.force:
        raise Refused(f"{' and '.join(map(str, existing))} already exist{'s' if len(existing) == 1 else ''}; "
                      f"pass --force to overwrite, or copy to another directory")
    command = run_command(name, directory, _command(source.read_text(), name))
    text = copied_yaml(source, name, py, command, directory)
    try:
        config.parent.mkdir(parents=True, exist_ok=True)
        for path in existing:
            path.unlink()
        shutil.copyfile(source.with_suffix(".py"), py)
        config.write_text(text)
    except OSError as exc:
        raise Refused(f"cannot copy into {directory}: {exc.strerror or exc}") from None
    out.print(f"copied recipe {name} to {escape(str(directory))}:")
    out.print(f"  {escape(str(py))}    the recipe's code: edit it")
    out.print(f"  {escape(str(config))}    its config (recipe.entry runs the copy)")
    out.print("run the copy:")
    out.print(f"  {escape(command)}", soft_wrap=True)
    out.print("check it:")
    out.print(f"  dlaunch recipes validate {escape(shlex.quote(str(directory)))}", soft_wrap=True)
    return 0


# ----- validate -----

@dataclasses.dataclass
class UserRecipe:
    path: Path
    node: Any  # DictConfig: the YAML as a run composes it (over dlaunch's recipe of the same name), recipe.name set
    strategies: list[str]


def find_recipe_yamls(path: Path) -> list[Path]:
    """A YAML file, or the recipe YAMLs in a directory (``DIR/*.yaml`` and ``DIR/recipe/*.yaml``, as ``cp`` writes)."""
    if path.is_file():
        return [path]
    if not path.exists():
        raise Refused(f"{path} does not exist")
    if not path.is_dir():
        raise Refused(f"{path} is neither a file nor a directory")
    found = [p for p in [*sorted(path.glob("*.yaml")), *sorted((path / "recipe").glob("*.yaml"))] if _has_recipe_section(p)]
    if not found:
        raise Refused(f"no recipe YAML in {path} (looked for a top-level recipe: section in {path}/*.yaml and {path}/recipe/*.yaml)")
    return found


def _has_recipe_section(path: Path) -> bool:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return True  # shown as that file's problem
    return isinstance(data, dict) and "recipe" in data


def load_user_recipe(path: Path) -> UserRecipe:
    from omegaconf import DictConfig, OmegaConf, open_dict

    where = str(path)
    try:
        node = OmegaConf.load(path)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([Problem(key=where, message=f"cannot read this YAML: {exc.problem or exc.context}{at}", has_value=False)]) from None
    except Exception as exc:  # noqa: BLE001 - YAML and OmegaConf errors alike: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError([Problem(key=where, message=f"cannot read this YAML: {first}", has_value=False)]) from None
    recipe = node.get("recipe") if isinstance(node, DictConfig) else None
    if not isinstance(recipe, DictConfig):
        raise ConfigError([Problem(key=where, message="not a recipe config: it needs a top-level recipe: mapping "
                                   "(recipe.strategies, recipe.optimizer, ... as in dlaunch recipes cp linear DIR)", has_value=False)])
    name = path.stem
    if _is_shipped(path):  # as a run composes it: dlaunch stores its own recipes under their name and module
        with open_dict(recipe):
            recipe.name, recipe.entry = name, f"launcher.recipes.{name}"
    # A user's copy (DIR/recipe/NAME.yaml, even with a shipped NAME) is validated as written: with
    # --config-dir DIR it replaces dlaunch's recipe of that name rather than merging over it.
    with open_dict(recipe):
        if recipe.get("name") is None:
            recipe.name = name
    try:
        declared = OmegaConf.to_container(recipe, resolve=False).get("strategies") or []
    except Exception:  # noqa: BLE001 - shown by the validation itself
        declared = []
    strategies = [str(s) for s in declared] if isinstance(declared, list) else []
    return UserRecipe(path=path, node=node, strategies=strategies)


def _is_shipped(path: Path) -> bool:
    return path.resolve() in {p.resolve() for p in shipped().values()}


def _key(override: str) -> str:
    return override.partition("=")[0].strip().lstrip("+~")


def plans(recipe: UserRecipe, overrides: list[str]) -> list[tuple[str, list[str]]]:
    """(label, overrides) for each strategy to check: the declared ones, or those the overrides name."""
    named = [o.partition("=")[2].strip() for o in overrides if _key(o) == "strategy"]
    strategies = named or recipe.strategies
    if not strategies:
        return [("default strategy (the recipe declares none)", list(overrides))]
    user_keys = {_key(o) for o in overrides}
    result = []
    for strategy in strategies:
        shape = [s for s in STRATEGY_SHAPES.get(strategy, ()) if _key(s) not in user_keys]
        own = [] if named else [f"strategy={strategy}"]
        result.append((" ".join([strategy, *shape]), [*own, *shape, *overrides]))
    return result


def compose_user(composer: Any, option: str, node: Any, overrides: list[str]) -> Any:
    """Compose dlaunch's defaults with the user's recipe YAML (stored as recipe ``option``) and ``overrides``.

    The same steps as ``compose.compose``; the recipe choice is not a shipped recipe, so it is added here,
    after the user's own overrides have had their group choices checked.
    """
    from hydra.core.config_store import ConfigStore
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    composer.register_configs(overrides)
    ConfigStore.instance().store(group="recipe", name=option, node=node, package="_global_", provider="dlaunch recipes")
    parsed = composer.parse_overrides(overrides)
    composer.check_group_choices(parsed)
    try:
        return _hydra_compose(composer, [f"recipe={option}", *overrides])
    except MissingConfigException as exc:
        missing = exc.missing_cfg_file
        group = missing.rsplit("/", 1)[0] if "/" in missing else missing
        raise ConfigError([Problem(key=group, value=missing.rsplit("/", 1)[-1], message="config not found",
                                   allowed=tuple(exc.options or ()))]) from None
    except (ConfigCompositionException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain(composer, option, parsed, exc)) from None


def _hydra_compose(composer: Any, overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(composer.CONF_DIR), version_base="1.3", job_name="dlaunch"):
        return hydra_compose("config", overrides=overrides)


def _is_group(key: str) -> bool:
    return key in ("strategy", "cluster", "recipe") or "/" in key


def _explain(composer: Any, option: str, parsed: list[Any], exc: Exception) -> list[Problem]:
    """Which override names a key that does not exist (with the nearest one), else Hydra's own first line."""
    try:
        base = _hydra_compose(composer, [f"recipe={option}", *(ov.input_line for ov in parsed if _is_group(ov.key_or_group))])
    except Exception:  # noqa: BLE001 - fall back to Hydra's words
        base = None
    problems = []
    for ov in parsed:
        if base is None or _is_group(ov.key_or_group) or ov.is_add() or ov.is_force_add():
            continue
        try:
            value = ov.get_value_element_as_str()
        except Exception:  # noqa: BLE001 - display only
            value = None
        problem = composer.unknown_key_problem(base, ov.key_or_group, value)
        if problem:
            problems.append(problem)
    if not problems:
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        problems.append(Problem(key="overrides", message=message, has_value=False))
    return problems


def _local_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _summary(problems: list[Problem]) -> str:
    parts = []
    for p in problems:
        shown = f" = {p.value}" if p.has_value else ""
        parts.append(f"{p.key}{shown}: {p.message}")
    text = "; ".join(parts)
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= 160 else text[:157] + "..."


def cmd_validate(args: argparse.Namespace, out: Console) -> int:
    from launcher.config import compose as composer

    for o in args.overrides:
        if _key(o) == "recipe":
            raise Refused(f"validate checks the recipe in {args.path}; leave out {o!r}")
    cuda = _local_cuda_devices() if args.cuda_devices is None else args.cuda_devices
    paths = find_recipe_yamls(Path(args.path).expanduser())
    problems: list[Problem] = []
    failed = False
    for index, path in enumerate(paths):
        try:
            recipe = load_user_recipe(path)
        except ConfigError as exc:
            out.print(f"[bold]{escape(str(path))}[/]", soft_wrap=True)
            out.print(f"  [red]FAIL[/]  {escape(_summary(exc.problems))}", soft_wrap=True)
            problems += [p for p in exc.problems if p not in problems]
            failed = True
            continue
        entry = recipe.node.recipe.get("entry")
        out.print(f"[bold]{escape(str(path))}[/]: recipe {escape(str(recipe.node.recipe.name))}, "
                  f"{'runs ' + escape(str(entry)) if entry else 'no recipe.entry'}", soft_wrap=True)
        option = f"{_VALIDATING}{index}"
        for label, overrides in plans(recipe, list(args.overrides)):
            try:
                composer.validate(compose_user(composer, option, recipe.node, overrides), cuda)
            except ConfigError as exc:
                out.print(f"  [red]FAIL[/]  {escape(label)}: {escape(_summary(exc.problems))}", soft_wrap=True)
                problems += [p for p in exc.problems if p not in problems]
                failed = True
                continue
            out.print(f"  [green]ok[/]    {escape(label)}", soft_wrap=True)
        _forget(option)
    if failed:
        render(ConfigError(problems))
        return 2
    return 0


def _forget(option: str) -> None:
    """Drop the user's recipe from Hydra's ConfigStore, so that it is no option of later runs in this process."""
    from hydra.core.config_store import ConfigStore

    try:
        ConfigStore.instance().repo.get("recipe", {}).pop(f"{option}.yaml", None)
    except AttributeError:  # a Hydra whose store is laid out otherwise: the entry stays, harmless
        pass


# ----- command line -----

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlaunch recipes", description="List, copy and check dlaunch recipes.")
    sub = p.add_subparsers(dest="command", metavar="{ls,cp,validate}", required=True)
    sub.add_parser("ls", help="the shipped recipes: strategies, purpose and the command that runs each")
    cp = sub.add_parser("cp", help="copy a recipe (.py and YAML) into DEST to edit and run it from there",
                        description="Copy NAME.py to DEST/NAME.py and NAME.yaml to DEST/recipe/NAME.yaml, whose "
                                    "recipe.entry runs the copy; prints the command that runs it.")
    cp.add_argument("name", metavar="NAME", help="a shipped recipe (dlaunch recipes ls)")
    cp.add_argument("dest", metavar="DEST", help="directory to copy into (created if missing)")
    cp.add_argument("--force", action="store_true", help="overwrite files already in DEST")
    va = sub.add_parser("validate", help="compose and validate a recipe config under every strategy it declares",
                        description="Compose PATH (a recipe YAML, or a directory holding recipe YAMLs, e.g. one made by "
                                    "dlaunch recipes cp) with dlaunch's defaults and each strategy it declares, and "
                                    "validate it as a run would. Exit 0 when all pass, 2 otherwise.")
    va.add_argument("path", metavar="PATH", help="a recipe YAML, or a directory holding one")
    va.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides, as for dlaunch (strategy=X checks X alone)")
    va.add_argument("--cuda-devices", type=int, default=None, metavar="N",
                    help="CUDA devices per node to validate for (default: this machine's)")
    return p


COMMANDS = {"ls": cmd_ls, "cp": cmd_cp, "validate": cmd_validate}


def main(argv: list[str]) -> int:
    """``dlaunch recipes ...``; ``argv`` is what follows ``recipes``. Returns the exit code."""
    p = parser()
    try:
        args, extra = p.parse_known_args(argv)
        if args.command == "validate" and not any(e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]  # overrides given after an option
        elif extra:
            p.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed by argparse
        return exc.code if isinstance(exc.code, int) else 2
    out = Console(highlight=False)
    try:
        return COMMANDS[args.command](args, out)
    except Refused as exc:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]dlaunch recipes {args.command}:[/] {escape(str(exc))}")
        return 2
    except ConfigError as exc:
        render(exc)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
