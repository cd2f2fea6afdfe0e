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
    title = "invalid configuration"
    hint = "See `dlaunch --help` for the config groups, `dlaunch --cfg job` for the composed config."

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__("; ".join(f"{p.key}: {p.message}" for p in self.problems))


class RecipeBesideScript(ConfigError):
    """A recipe chosen or set beside a script; ``rest``: the other overrides, whose own problems join these."""

    def __init__(self, problems: Iterable[Problem], rest: list[str]):
        super().__init__(problems)
        self.rest = rest


class UserCodeError(ConfigError):
    """The user's own code (a recipe module at import) raised: the root cause, exit code 1."""

    exit_code = 1
    title = "the recipe's code failed"
    hint = ("Fix it where it points (the recipe's file, or a module it imports); `dlaunch recipes validate DIR` checks "
            "a recipe directory without training.")


# Other tools' words for dlaunch's values: torchrun's and Accelerate's devices, precisions and strategies.
_SYNONYMS = {"gpu": "cuda", "nvidia": "cuda", "ddp": "mirrored", "bfloat16": "bf16-mixed",
             "float16": "fp16-mixed", "half": "fp16-mixed", "16-mixed": "fp16-mixed", "float32": "fp32", "32-true": "fp32",
             # tf.distribute's class names, as a TF user types them for strategy=
             "mirroredstrategy": "mirrored", "multiworkermirroredstrategy": "multi_worker_mirrored",
             "centralstoragestrategy": "central_storage", "parameterserverstrategy": "parameter_server",
             "parameterserverstrategyv2": "parameter_server", "onedevicestrategy": "one_device", "tpustrategy": "mesh",
             "tpu": "mesh", "fullyshardeddataparallel": "fsdp"}


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate ``word`` was probably meant as: the same but for case (``SGD``), the one it begins (``bf16`` for
    ``bf16-mixed``), else the closest spelling."""
    options = sorted(set(map(str, candidates)))
    if _SYNONYMS.get(str(word).lower()) in options:  # another tool's word for one of these (gpu: cuda)
        return _SYNONYMS[str(word).lower()]
    for same in ([c for c in options if c.lower() == str(word).lower()], [c for c in options if c.startswith(str(word))]):
        if len(same) == 1 and str(word):
            return same[0]
    matches = difflib.get_close_matches(str(word), options, n=1, cutoff=0.6)
    return matches[0] if matches else None


MAX_LINES = 25  # one screen, whatever the problems say


def render(error: ConfigError, console: Console | None = None) -> None:
    """Print the problems to stderr: at most ``MAX_LINES`` lines, never a traceback. Each problem in full (its key and
    value, what is wrong, what was meant, what is allowed) where all fit; else each on one line, with the same."""
    console = console or Console(emoji=False, stderr=True, highlight=False, soft_wrap=True)
    n = len(error.problems)
    console.print(f"[bold red]dlaunch: {error.title}[/] ({n} problem{'s' if n != 1 else ''})")
    full = _each(error.problems, _lines)
    if sum(map(len, full)) + 3 <= MAX_LINES:  # the title and the closing hint
        console.print("\n".join(line for lines in full for line in lines))
    else:
        console.print("")
        compact = [line for lines in _each(error.problems, _line) for line in lines]
        room = MAX_LINES - 5  # the title, a blank line each side, the hint; and the line naming the rest
        shown = compact if len(compact) <= room + 1 else compact[:room]
        console.print("\n".join(shown))
        if len(shown) < n:  # every key is still named, on one line
            rest = ", ".join(_clean(p.key) + (f" (did you mean {_clean(p.suggestion)}?)" if p.suggestion else "")
                             for p in error.problems[len(shown):])
            console.print(f"  ... and {n - len(shown)} more: {escape(_clean(rest, 600))}")
    console.print(f"\n{error.hint}")


def _each(problems: list[Problem], shape: Any) -> list[list[str]]:
    """Each problem's printed lines; a list of allowed values only where no problem above has listed the same."""
    listed: set = set()
    out = []
    for p in problems:
        out.append(shape(p, p.allowed not in listed))
        listed.add(p.allowed)
    return out


def _lines(p: Problem, with_allowed: bool = True) -> list[str]:
    """One problem as printed lines (rich markup; every user-given text escaped and made one line)."""
    shown = f" = {escape(_short(p.value))}" if p.has_value else ""
    lines = ["", f"  [bold]{escape(_clean(p.key))}[/]{shown}", f"    {escape(_clean(p.message, 400))}"]
    if p.suggestion:
        lines.append(f"    did you mean [green]{escape(_clean(p.suggestion))}[/]?")
    if p.allowed and with_allowed:
        lines.append(f"    allowed: {escape(_clean(', '.join(p.allowed)))}")
    return lines


def _line(p: Problem, with_allowed: bool = True) -> list[str]:
    """One problem on one line: ``key = value: message; did you mean X?; allowed: ...``."""
    shown = f" = {escape(_short(p.value))}" if p.has_value else ""
    text = f"  [bold]{escape(_clean(p.key))}[/]{shown}: {escape(_clean(p.message, 300))}"
    if p.suggestion:
        text += f"; did you mean [green]{escape(_clean(p.suggestion))}[/]?"
    if p.allowed and with_allowed:
        text += f"; allowed: {escape(_clean(', '.join(p.allowed), 300))}"
    return [text]


def spelled(value: Any) -> str:
    """The value as a user types it on the command line: ``true``, ``null``, ``''``, not Python's spelling."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value) if isinstance(value, str) and value == "" else str(value)


def _short(value: Any, limit: int = 60) -> str:
    return _clean(spelled(value), limit)


def _clean(text: str, limit: int = 200) -> str:
    """``text`` on one line: control characters (newlines, terminal escapes) shown escaped, then clipped."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return text if len(text) <= limit else text[: limit - 3] + "..."
