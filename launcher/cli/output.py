"""Where dlaunch's own output goes: results on stdout, logs and errors on stderr.

Results are what a user keeps (``dlaunch ... > run.txt``): the plan, the result
table, a sweep's table. Off a terminal they are plain lines: no colour, no
wrapping at 80 columns, no padding after the last character.
"""

from __future__ import annotations

import io
import sys
from typing import TextIO

from rich.console import Console

WIDTH_OFF_TERMINAL = 1000  # a log file has no edge: keep each plan row and message on one line


class _Unpadded(io.TextIOBase):
    """A stream that drops the spaces rich pads table cells with at the end of each line."""

    def __init__(self, out: TextIO):
        self._out = out
        self._pending = ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._out.write(line.rstrip() + "\n")
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._out.write(self._pending.rstrip())
            self._pending = ""
        self._out.flush()


def console(stderr: bool = False) -> Console:
    """A rich console on stdout (results) or stderr (messages): rich on a terminal, plain lines elsewhere."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(emoji=False, file=stream, highlight=False)
    return Console(emoji=False, file=_Unpadded(stream), highlight=False, width=WIDTH_OFF_TERMINAL, no_color=True, soft_wrap=False)


def results() -> Console:
    """stdout: the plan, the result table, a sweep's table."""
    return console(stderr=False)


def messages() -> Console:
    """stderr: notes, warnings and errors around a run."""
    return console(stderr=True)
