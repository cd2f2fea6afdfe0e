"""``dlaunch recipes cp SRC DEST``: a shipped recipe's module and YAML, copied to edit and run from their own directory.

As ``cp`` copies a file: into a directory (one that exists, or ``DIR/``) under the recipe's own name, else under the
name DEST ends in, in DEST's directory (the current one for a bare name), with that name's edits made.

    dlaunch recipes cp linear my_recipes/   # my_recipes/linear.py + my_recipes/recipe/linear.yaml: recipe=linear
    dlaunch recipes cp linear mine          # ./mine.py + ./recipe/mine.yaml: dlaunch --config-dir . recipe=mine
"""

from __future__ import annotations

import argparse
import json
import os
import re
import ast
import shlex
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape

from launcher.cli.recipes import Refused, command_of, shipped
from launcher.config.errors import did_you_mean


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

    The first line is the command that runs the copy, and a comment's ``dlaunch recipe=SRC`` runs the copy too.
    dlaunch reads a user's recipe YAML itself (as ``_global_``), so no ``# @package`` header is needed; the recipe's
    name (``name``) is the file's, so a renamed copy runs under its new name.
    """
    lines = source.read_text().splitlines()
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("#") and _is_header_or_command(lines[0])):
        lines.pop(0)
    runs_copy = shlex.join(["dlaunch", "--config-dir", directory, f"recipe={name}"])
    lines = [re.sub(rf"\bdlaunch recipe={re.escape(source.stem)}(?![\w-])", lambda _: runs_copy, line)
             if line.lstrip().startswith("#") else line for line in lines]
    entry = ENTRY.format(name=name)
    named = "" if name == source.stem else f", named {name}"
    head = [
        f"# {command}",
        f"# A copy of dlaunch's recipe {source.stem}{named}: recipe.entry runs {entry} (relative to this file), so edits "
        "there take effect.",
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


def copied_module(source: Path, name: str, directory: str) -> str:
    """The shipped module, with each ``dlaunch recipe=SRC`` (and ``python -m launcher.recipes.SRC``) of its docstring
    running the copy instead; all else as is."""
    text = source.read_text()
    try:
        body = ast.parse(text).body
    except SyntaxError:
        return text
    first = body[0] if body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)):
        return text
    lines = text.splitlines(keepends=True)
    runs_copy = shlex.join(["dlaunch", "--config-dir", directory, f"recipe={name}"])
    old = re.compile(rf"\bdlaunch recipe={re.escape(source.stem)}(?![\w-])")
    module = re.compile(rf"\bpython -m launcher\.recipes\.{re.escape(source.stem)}\b")  # the data writer: the copy's
    doc = old.sub(lambda _: runs_copy, "".join(lines[: first.end_lineno]))
    doc = module.sub(lambda _: shlex.join(["python", str(Path(directory) / f"{name}.py")]), doc)
    return doc + "".join(lines[first.end_lineno :])


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


NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")  # what recipe=NAME takes for a name, not a path


def destination(dest: str, source: str) -> tuple[Path, str, str]:
    """(the directory, the copy's name, the directory as the printed commands give it) for ``cp SOURCE DEST``: an
    existing directory or ``DIR/`` keeps the source's name; else DEST's last part names the copy, in DEST's
    directory (``.`` for a bare name)."""
    typed = Path(dest).expanduser()
    if dest.endswith(("/", os.sep)) or typed.is_dir():
        return typed.resolve(), source, str(typed)
    name = typed.name.removesuffix(".py").removesuffix(".yaml").removesuffix(".yml")
    if not NAME.fullmatch(name):
        raise Refused(f"{name!r} cannot name a recipe (recipe={name} would not choose it): use letters, digits, _ "
                      f"and -; to copy into a directory, end it with /")
    directory = typed.parent
    if (directory / "config.yaml").exists():  # --config-dir DIR would make it the run's primary config
        raise Refused(f"{directory.resolve()} holds config.yaml, which --config-dir {directory} would run in place of "
                      f"dlaunch's own config; copy into a directory of its own (DIR/{name})")
    return directory.resolve(), name, str(directory)


def cmd_cp(args: argparse.Namespace, out: Console) -> int:
    recipes = shipped()
    if args.name not in recipes:
        guess = did_you_mean(args.name, recipes)
        hint = f"; did you mean {guess}?" if guess else ""
        raise Refused(f"unknown recipe {args.name!r}{hint} (available: {', '.join(recipes)})")
    directory, name, shown = destination(args.dest, args.name)  # shown: as typed, a relative DIR stays relocatable
    if directory.exists() and not directory.is_dir():
        raise Refused(f"{directory} exists and is not a directory")
    py, config = directory / f"{name}.py", directory / "recipe" / f"{name}.yaml"
    source = recipes[args.name]
    if py.resolve() == source.with_suffix(".py").resolve():
        raise Refused(f"{directory} is where dlaunch's own recipe {name} lives; copy it to another directory")
    existing = [p for p in (py, config) if p.exists() or p.is_symlink()]
    if any(p.is_dir() for p in existing):
        raise Refused(f"{next(p for p in existing if p.is_dir())} is a directory; cannot copy the recipe over it")
    if existing and not args.force:
        raise Refused(f"{' and '.join(map(str, existing))} already exist{'s' if len(existing) == 1 else ''}; "
                      f"pass --force to overwrite, or copy to another directory")
    command = run_command(name, shown, command_of(source.read_text(), args.name))
    text = copied_yaml(source, name, command, shown)
    try:
        config.parent.mkdir(parents=True, exist_ok=True)
        for path in existing:
            path.unlink()
        py.write_text(copied_module(source.with_suffix(".py"), name, shown))
        config.write_text(text)
    except OSError as exc:
        raise Refused(f"cannot copy into {directory}: {exc.strerror or exc}") from None
    named = "" if name == args.name else f" as {name}"
    out.print(f"copied recipe {args.name}{named} to {escape(str(directory))}:", soft_wrap=True)
    out.print(f"  {escape(str(py))}    the recipe's code: edit it", soft_wrap=True)
    out.print(f"  {escape(str(config))}    its config (recipe.entry: {ENTRY.format(name=name)}, the copy)", soft_wrap=True)
    out.print("run the copy:")
    out.print(f"  {escape(command)}", soft_wrap=True)
    out.print("check it:")
    out.print(f"  dlaunch recipes validate {escape(shlex.quote(shown))}", soft_wrap=True)
    return 0


