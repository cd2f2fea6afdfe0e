"""``dlaunch recipes``: list the shipped recipes, copy one to edit, check a recipe config.

    dlaunch recipes ls                              # name, strategies, purpose, command of each recipe
    dlaunch recipes cp linear my_recipes/           # my_recipes/linear.py + my_recipes/recipe/linear.yaml
    dlaunch --config-dir my_recipes recipe=linear   # runs the copy (cp prints this line); edits take effect
    dlaunch recipes validate my_recipes/            # compose + validate it under every strategy it declares

A copy is relocatable: its YAML's ``recipe.entry`` is ``../NAME.py``, relative to
the YAML, so the directory can be moved or committed; edits to either file take
effect without touching the installed package. The YAML's first line is the
command that runs it. Exit codes: 0 done, 2 refused or invalid.
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

import yaml
from rich.console import Console
from rich.markup import escape

from launcher import strategies
from launcher.cluster import gpus
from launcher.config.errors import ConfigError, Problem, UserCodeError, did_you_mean, render

# The cluster shape each strategy is checked with: its unit's example (several replicas where it has them).
STRATEGY_SHAPES: dict[str, tuple[str, ...]] = {name: unit.example for name, unit in strategies.units().items()}


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
    """One block per recipe; the command on a line of its own, never wrapped, so that it can be copied."""
    for name, path in shipped().items():
        info = describe(name, path)
        out.print(f"[bold]{escape(info.name)}[/]  {escape(plain(info.purpose))}", soft_wrap=True)
        out.print(f"  strategies: {escape(', '.join(info.strategies))}", soft_wrap=True)
        out.print(f"  {escape(info.command)}", soft_wrap=True)
    out.print("Copy one to edit it: dlaunch recipes cp NAME DIR; check a config: dlaunch recipes validate PATH", soft_wrap=True)
    return 0


def plain(text: str) -> str:
    """A docstring line without its reStructuredText markup (``code``, :role:`target`)."""
    return re.sub(r"``([^`]*)``", r"\1", re.sub(r":\w+:`([^`]*)`", r"\1", text))


# ----- cp -----

def run_command(name: str, directory: str, shipped_command: str) -> str:
    """The shell command that runs the copy in ``directory``: the shipped command, with ``--config-dir`` searched first."""
    try:
        words = shlex.split(shipped_command)
    except ValueError:
        words = []
    if words[:1] != ["dlaunch"]:
        words = ["dlaunch"]
    rest = [w for w in words[1:] if not w.startswith(("recipe=", "hydra.searchpath="))]
    return shlex.join(["dlaunch", "--config-dir", directory, f"recipe={name}", *rest])


ENTRY = "../{name}.py"  # relative to DIR/recipe/NAME.yaml: the copy moves with its directory


def copied_yaml(source: Path, name: str, command: str, directory: str) -> str:
    """The shipped YAML, its comments kept, with ``recipe.entry`` the copied .py (relative) and no ``recipe.name``.

    The first line is the command that runs the copy. dlaunch reads a user's recipe YAML itself (as ``_global_``),
    so no ``# @package`` header is needed; the recipe's name is the file's, so a renamed copy runs under its new name.
    """
    lines = source.read_text().splitlines()
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("#") and _is_header_or_command(lines[0])):
        lines.pop(0)
    entry = ENTRY.format(name=name)
    head = [
        f"# {command}",
        f"# A copy of dlaunch's recipe {name}: recipe.entry runs {entry} (relative to this file), so edits there take effect.",
        f"# Check it: dlaunch recipes validate {shlex.quote(directory)}",
    ]
    text = "\n".join([*head, *_with_entry(lines, entry)]) + "\n"
    if _loads_as(text, source, entry):
        return text
    # A layout the line edit cannot handle (flow style, anchors...): write the data, without the comments.
    data = yaml.safe_load(source.read_text()) or {}
    rest = {k: v for k, v in (data.get("recipe") or {}).items() if k not in ("name", "entry")}
    data["recipe"] = {"entry": entry, **rest}
    return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False)


def _is_header_or_command(line: str) -> bool:
    text = line.strip().lstrip("#").strip()
    return text.startswith("@") or text.startswith("dlaunch ")


def _with_entry(lines: list[str], entry: str) -> list[str]:
    """``lines`` with ``entry:`` first under the top-level ``recipe:`` key (any ``name:`` and ``entry:`` dropped)."""
    start = next((i for i, line in enumerate(lines) if re.match(r"^recipe:\s*(#.*)?$", line)), None)
    if start is None:
        return [*lines, "recipe:", f"  entry: {json.dumps(entry)}"]
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith((" ", "\t", "#"))):
        end += 1
    block = lines[start + 1 : end]
    indent = next((re.match(r"^\s*", line).group(0) for line in block if line.strip() and not line.lstrip().startswith("#")), "  ")
    kept = [line for line in block if not re.match(rf"^{re.escape(indent)}(name|entry)\s*:", line)]
    return [*lines[: start + 1], f"{indent}entry: {json.dumps(entry)}", *kept, *lines[end:]]


def _loads_as(text: str, source: Path, entry: str) -> bool:
    """``text`` holds the source's data with only recipe.entry set (and no recipe.name)."""
    try:
        new, old = yaml.safe_load(text), yaml.safe_load(source.read_text())
    except yaml.YAMLError:
        return False
    if not isinstance(new, dict) or not isinstance(old, dict) or not isinstance(new.get("recipe"), dict):
        return False
    recipe = {k: v for k, v in (old.get("recipe") or {}).items() if k != "name"}
    return new == {**old, "recipe": {**recipe, "entry": entry}}


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
    shown = str(Path(args.dest).expanduser())  # as typed: a relative DIR keeps the command relocatable
    command = run_command(name, shown, _command(source.read_text(), name))
    text = copied_yaml(source, name, command, shown)
    try:
        config.parent.mkdir(parents=True, exist_ok=True)
        for path in existing:
            path.unlink()
        shutil.copyfile(source.with_suffix(".py"), py)
        config.write_text(text)
    except OSError as exc:
        raise Refused(f"cannot copy into {directory}: {exc.strerror or exc}") from None
    out.print(f"copied recipe {name} to {escape(str(directory))}:", soft_wrap=True)
    out.print(f"  {escape(str(py))}    the recipe's code: edit it", soft_wrap=True)
    out.print(f"  {escape(str(config))}    its config (recipe.entry: {ENTRY.format(name=name)}, the copy)", soft_wrap=True)
    out.print("run the copy:")
    out.print(f"  {escape(command)}", soft_wrap=True)
    out.print("check it:")
    out.print(f"  dlaunch recipes validate {escape(shlex.quote(shown))}", soft_wrap=True)
    return 0


# ----- validate -----

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


def _key(override: str) -> str:
    return override.partition("=")[0].strip().lstrip("+~")


def plans(strategies: list[str], overrides: list[str]) -> list[tuple[str, list[str]]]:
    """(label, overrides) for each strategy to check: the declared ones, or those the overrides name."""
    named = [o.partition("=")[2].strip() for o in overrides if _key(o) == "strategy"]
    strategies = named or strategies
    if not strategies:
        return [("default strategy (the recipe declares none)", list(overrides))]
    user_keys = {_key(o) for o in overrides}
    result = []
    for strategy in strategies:
        shape = [s for s in STRATEGY_SHAPES.get(strategy, ()) if _key(s) not in user_keys]
        own = [] if named else [f"strategy={strategy}"]
        result.append((" ".join([strategy, *shape]), [*own, *shape, *overrides]))
    return result


def _summary(problems: list[Problem]) -> str:
    parts = []
    for p in problems:
        shown = f" = {p.value}" if p.has_value else ""
        parts.append(f"{p.key}{shown}: {p.message}")
    text = "; ".join(parts)
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= 160 else text[:157] + "..."


def cmd_validate(args: argparse.Namespace, out: Console) -> int:
    """Each recipe YAML is chosen as a run chooses ``recipe=PATH`` (launcher.config.user_recipes), so the two agree."""
    from omegaconf import ListConfig

    from launcher.config import compose as composer
    from launcher.config import user_recipes

    for o in args.overrides:
        if _key(o) == "recipe":
            raise Refused(f"validate checks the recipe in {args.path}; leave out {o!r}")
    cuda = gpus.count() if args.cuda_devices is None else args.cuda_devices
    found: dict[type[ConfigError], list[Problem]] = {ConfigError: [], UserCodeError: []}
    for path in find_recipe_yamls(Path(args.path).expanduser()):
        try:
            option = composer.recipe_option(path)
            recipe = user_recipes.node(path.resolve(), composer.recipe_files()).recipe
        except ConfigError as exc:
            out.print(f"[bold]{escape(str(path))}[/]", soft_wrap=True)
            out.print(f"  [red]FAIL[/]  {escape(_summary(exc.problems))}", soft_wrap=True)
            _collect(found, exc)
            continue
        out.print(f"[bold]{escape(str(path))}[/]: recipe {escape(str(recipe.name))}, runs {escape(str(recipe.entry))}", soft_wrap=True)
        declared = recipe.get("strategies")
        declared = [str(s) for s in declared] if isinstance(declared, ListConfig) else []
        for label, overrides in plans(declared, list(args.overrides)):
            try:
                composer.compose_and_validate([f"recipe={option}", *overrides], cuda)
            except ConfigError as exc:
                out.print(f"  [red]FAIL[/]  {escape(label)}: {escape(_summary(exc.problems))}", soft_wrap=True)
                _collect(found, exc)
                continue
            out.print(f"  [green]ok[/]    {escape(label)}", soft_wrap=True)
    return _verdict(found)


def _collect(found: dict[type[ConfigError], list[Problem]], exc: ConfigError) -> None:
    """Each problem once, with its kind: the recipe's own code failing, or the config."""
    kind = UserCodeError if isinstance(exc, UserCodeError) else ConfigError
    found[kind] += [p for p in exc.problems if p not in found[kind]]


def _verdict(found: dict[type[ConfigError], list[Problem]]) -> int:
    """The problems as a run would show them, under the same titles; a run's exit code: 2 for the config, else 1
    where only the recipe's code failed (an import error), else 0."""
    for kind, problems in found.items():
        if problems:
            render(kind(problems))
    return 2 if found[ConfigError] else 1 if found[UserCodeError] else 0


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
                        usage="dlaunch recipes validate [-h] [--cuda-devices N] PATH [OVERRIDE ...]",
                        description="Compose PATH (a recipe YAML, or a directory holding recipe YAMLs, e.g. one made by "
                                    "dlaunch recipes cp) with dlaunch's defaults and each strategy it declares, and "
                                    "validate it as a run would. Exit 0 when all pass, 2 for a config problem, 1 "
                                    "where only the recipe's own code failed (as a run exits).")
    va.add_argument("path", nargs="?", metavar="PATH", help="a recipe YAML, or a directory holding one")
    va.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra overrides, as for dlaunch (strategy=X checks X alone)")
    va.add_argument("--cuda-devices", type=int, default=None, metavar="N",
                    help="CUDA devices per node to validate for (default: this machine's)")
    COMMAND_PARSERS["validate"] = va
    return p


COMMAND_PARSERS: dict[str, argparse.ArgumentParser] = {}


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
        if args.command == "validate" and args.path is None:  # argparse would name OVERRIDE as required too
            COMMAND_PARSERS["validate"].error("the following argument is required: PATH")
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
