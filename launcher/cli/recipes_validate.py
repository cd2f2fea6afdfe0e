"""``dlaunch recipes validate PATH``: compose and validate a recipe YAML under every strategy it declares, as a run would.

    dlaunch recipes validate my_recipes/            # each recipe YAML there, under each of its strategies
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape

from launcher import strategies
from launcher.cli.recipes import Refused
from launcher.cluster import gpus
from launcher.config.errors import ConfigError, Problem, UserCodeError, render
from launcher.config.overrides import key_of

# The cluster shape each strategy is checked with: its unit's example (several replicas where it has them).
STRATEGY_SHAPES: dict[str, tuple[str, ...]] = {name: unit.example for name, unit in strategies.units().items()}


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


def plans(strategies: list[str], overrides: list[str]) -> list[tuple[str, list[str]]]:
    """(label, overrides) for each strategy to check: the declared ones, or those the overrides name."""
    named = [o.partition("=")[2].strip() for o in overrides if key_of(o) == "strategy"]
    strategies = named or strategies
    if not strategies:
        return [("default strategy (the recipe declares none)", list(overrides))]
    user_keys = {key_of(o) for o in overrides}
    result = []
    for strategy in strategies:
        shape = [s for s in STRATEGY_SHAPES.get(strategy, ()) if key_of(s) not in user_keys]
        own = [] if named else [f"strategy={strategy}"]
        result.append((" ".join([strategy, *shape]), [*own, *shape, *overrides]))
    return result


def _summary(problems: list[Problem]) -> str:
    """The problems on one line, at most 160 characters; the YAML a key is set in is the line above's."""
    parts = []
    for p in problems:
        shown = f" = {p.value}" if p.has_value else ""
        parts.append(f"{p.key}{shown}: {p.message.split(', set in ', 1)[0]}")
    text = "; ".join(parts)
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= 160 else text[:157] + "..."


def cmd_validate(args: argparse.Namespace, out: Console) -> int:
    """Each recipe YAML is chosen as a run chooses ``recipe=PATH`` (launcher.config.user_recipes), so the two agree."""
    from omegaconf import ListConfig

    from launcher.config import compose as composer
    from launcher.config import user_recipes

    for o in args.overrides:
        if key_of(o) == "recipe":
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
        results: list[tuple[str, list[Problem] | None]] = []
        # the example shapes are validate's choice: where this machine's GPUs are too few for one, it is checked on the CPU
        on_cpu = args.cuda_devices is None and cuda > 0 and not any(key_of(o) == "cluster.device" for o in args.overrides)
        for label, overrides in plans(declared, list(args.overrides)):
            exc = _checked(option, overrides, cuda)
            if exc is not None and on_cpu and _too_few_gpus(exc.problems):
                label += f" (on the CPU: this machine has {cuda} CUDA device{'s' * (cuda != 1)})"
                exc = _checked(option, [*overrides, "cluster.device=cpu"], cuda)
            results.append((label, None if exc is None else exc.problems))
            if exc is not None:
                _collect(found, exc)
        _show(results, out)
    return _verdict(found)


def _checked(option: str, overrides: list[str], cuda: int) -> ConfigError | None:
    """The recipe composed with ``overrides`` and validated as a run would be: its error, None where it passes."""
    from launcher.config import compose as composer

    try:
        composer.compose_and_validate([f"recipe={option}", *overrides], cuda)
    except ConfigError as exc:
        return exc
    return None


def _too_few_gpus(problems: list[Problem]) -> bool:
    """Only the machine's CUDA device count stands in the way (``run_rules.devices_exist``)."""
    return bool(problems) and all(p.key in ("cluster.devices_per_node", "cluster.nodes") and "CUDA device" in p.message
                                  for p in problems)


def _show(results: list[tuple[str, list[Problem] | None]], out: Console) -> None:
    """One line per strategy checked (``label``, its problems or None); a problem every strategy has (a typo in the
    YAML) is said once, on a line of its own, not again on each strategy's."""
    everywhere = [p for p in results[0][1] or [] if all(p in (problems or []) for _, problems in results[1:])]
    if len(results) > 1 and everywhere:
        names = ", ".join(label.split()[0] for label, _ in results)
        out.print(f"  [red]FAIL[/]  all {len(results)} strategies ({escape(names)}): {escape(_summary(everywhere))}",
                  soft_wrap=True)
    else:
        everywhere = []
    for label, problems in results:
        own = [p for p in problems or [] if p not in everywhere]
        if problems is None:
            out.print(f"  [green]ok[/]    {escape(label)}", soft_wrap=True)
        elif own:
            out.print(f"  [red]FAIL[/]  {escape(label)}: {escape(_summary(own))}", soft_wrap=True)


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


