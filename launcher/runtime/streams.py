"""A process's stdout and stderr once their reader may leave: ``dlaunch ... | head`` reads a few lines and exits.

Python ignores SIGPIPE, so the next write raises ``BrokenPipeError``. In dlaunch's own process that ended the
command with exit 1 and no word, whatever the run did (a completed run's summary said ``completed``); in a rank,
a ``print`` would end the rank. ``reader_may_leave()`` wraps both streams: once the reader has gone, what
follows is written to ``/dev/null`` and the run goes on to its own exit code. Its log lines are also in the
run's ``dlaunch.log``, its result in ``summary.json``.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO


class ReaderMayLeave:
    """``stream`` as it is, until a write or flush finds its reader gone; from then on its descriptor is
    ``/dev/null`` (what is still buffered goes there too)."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_null()
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_null()
            self._stream.flush()

    def _to_null(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer, ...: the stream's
        return getattr(self._stream, name)


def reader_may_leave() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` (once; a stream without a descriptor is left as it is)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, ReaderMayLeave):
            continue
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        setattr(sys, name, ReaderMayLeave(stream))
