"""The config error screen (launcher/config/errors.py): one screen, every bad key named, never a traceback."""

from __future__ import annotations

import io

from rich.console import Console

from launcher.config.errors import MAX_LINES, ConfigError, Problem, render


def screen(problems: list[Problem]) -> str:
    out = io.StringIO()
    render(ConfigError(problems), Console(file=out, highlight=False, soft_wrap=True, width=100))
    return out.getvalue()


def test_problems_that_fit_are_shown_in_full_with_what_was_meant_and_allowed():
    text = screen([Problem("trainer.stepz", "unknown key", 5, suggestion="trainer.steps", allowed=("steps", "seed"))])
    assert "  trainer.stepz = 5\n    unknown key\n    did you mean trainer.steps?\n    allowed: steps, seed\n" in text


def test_more_problems_than_a_screen_holds_name_every_key_each_on_one_line_then_by_name():
    """30 unknown keys: 20 on a line each (key, value, meaning, the allowed list once), the other 10 by name."""
    problems = [Problem(f"trainer.k{i}", "unknown key", i, allowed=("steps", "seed")) for i in range(30)]
    text = screen(problems)
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES and "invalid configuration (30 problems)" in lines[0], text
    assert "  trainer.k0 = 0: unknown key; allowed: steps, seed" in lines and "  trainer.k1 = 1: unknown key" in lines
    shown = sum(line.startswith("  trainer.k") for line in lines)
    assert shown == MAX_LINES - 5 and f"  ... and {30 - shown} more: trainer.k{shown}, " in text, text
    assert all(f"trainer.k{i}" in text for i in range(30))
