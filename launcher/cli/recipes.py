"""``dlaunch recipes``: list the shipped recipes, copy one to edit, check a recipe config.

    dlaunch recipes ls                              # name, strategies, purpose, command of each recipe
    dlaunch recipes cp linear my_recipes/           # my_recipes/linear.py + my_recipes/recipe/linear.yaml
    dlaunch --config-dir my_recipes recipe=linear   # runs the copy (cp prints this line); edits take effect
    dlaunch recipes cp linear my_recipes/mine       # the same, named mine: --config-dir my_recipes recipe=mine
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
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape

from launcher.config.errors import ConfigError, render


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
    return RecipeInfo(name=name, strategies=strategies, purpose=_purpose(yaml_path.with_suffix(".py")), command=command_of(text, name))


def _purpose(py: Path) -> str:
    """The first line of the module's docstring."""
    try:
        doc = ast.get_docstring(ast.parse(py.read_text(), filename=str(py))) or ""
    except (OSError, SyntaxError, ValueError):
        return ""
    return next((line.strip() for line in doc.splitlines() if line.strip()), "")


def command_of(yaml_text: str, name: str) -> str:
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
    out.print("Copy one to edit it: dlaunch recipes cp NAME DIR/ (or [DIR/]NEWNAME); check a config: dlaunch recipes "
              "validate PATH", soft_wrap=True)
    return 0


def plain(text: str) -> str:
    """A docstring line without its reStructuredText markup (``code``, :role:`target`)."""
    return re.sub(r"``([^`]*)``", r"\1", re.sub(r":\w+:`([^`]*)`", r"\1", text))


# ----- command line -----

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlaunch recipes", description="List, copy and check dlaunch recipes.")
    sub = p.add_subparsers(dest="command", metavar="{ls,cp,validate}", required=True)
    sub.add_parser("ls", help="the shipped recipes: strategies, purpose and the command that runs each")
    cp = sub.add_parser("cp", help="copy a recipe (.py and YAML) to DEST to edit and run it from there",
                        description="As cp copies a file. DEST a directory (one that exists, or DIR/): NAME.py to "
                                    "DIR/NAME.py and NAME.yaml to DIR/recipe/NAME.yaml. DEST [DIR/]NEW: the copy is "
                                    "the recipe NEW, DIR/NEW.py and DIR/recipe/NEW.yaml (DIR: the current directory "
                                    "for a bare NEW). Its recipe.entry runs the copy; prints the command that runs it.")
    cp.add_argument("name", metavar="NAME", help="a shipped recipe (dlaunch recipes ls)")
    cp.add_argument("dest", metavar="DEST", help="DIR/ to copy into (created if missing), or [DIR/]NEW to copy as recipe NEW")
    cp.add_argument("--force", action="store_true", help="overwrite the copy's files where they exist")
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


def command(name: str) -> Any:
    """The function that runs ``dlaunch recipes NAME`` (cp and validate each in a module of their own)."""
    from launcher.cli import recipes_cp, recipes_validate

    return {"ls": cmd_ls, "cp": recipes_cp.cmd_cp, "validate": recipes_validate.cmd_validate}[name]


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
    out = Console(emoji=False, highlight=False)
    try:
        return command(args.command)(args, out)
    except Refused as exc:
        Console(emoji=False, stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]dlaunch recipes {args.command}:[/] {escape(str(exc))}")
        return 2
    except ConfigError as exc:
        render(exc)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
