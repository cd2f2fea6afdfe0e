"""Config errors: one screen naming the key, the bad value and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Iterable

from rich.console import Console
from rich.markup import escape


@dataclasses.dataclass(frozen=True)
class Problem:
    key: str
    message: str
    value: Any = dataclasses.field(default=None)
    has_value: bool = True
    allowed: tuple[str, ...] = ()
    suggestion: str | None = None


class ConfigError(Exception):
    """One or more problems with the composed config; exit code 2."""

    exit_code = 2

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__("; ".join(f"{p.key}: {p.message}" for p in self.problems))


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(str(word), sorted(set(candidates)), n=1, cutoff=0.6)
    return matches[0] if matches else None


MAX_PROBLEMS = 6


def render(error: ConfigError, console: Console | None = None) -> None:
    """Print the problems to stderr: at most a screenful, never a traceback."""
    console = console or Console(stderr=True, highlight=False, soft_wrap=True)
    n = len(error.problems)
    console.print(f"[bold red]dlaunch: invalid configuration[/] ({n} problem{'s' if n != 1 else ''})")
    for p in error.problems[:MAX_PROBLEMS]:
        shown = f" = {escape(_short(p.value))}" if p.has_value else ""
        console.print(f"\n  [bold]{escape(p.key)}[/]{shown}")
        console.print(f"    {escape(p.message)}")
        if p.suggestion:
            console.print(f"    did you mean [green]{escape(p.suggestion)}[/]?")
        if p.allowed:
            console.print(f"    allowed: {escape(', '.join(p.allowed))}")
    if n > MAX_PROBLEMS:
        console.print(f"\n  ... and {n - MAX_PROBLEMS} more")
    console.print("\nSee `dlaunch --help` for the config groups, `dlaunch --cfg job` for the composed config.")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value) if isinstance(value, str) and value == "" else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
