"""A Ctrl-C before the run's own signal handling: noted at once, acted on at the next safe point.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread is. In the first second of a
run that is mostly inside ``import torch``, whose C extension imports NumPy and swallows any error
that import raises (it goes on without NumPy support): a Ctrl-C there was lost, and the run trained to
its end. Elsewhere in those imports it printed a traceback from deep inside a library.

So the console script notes the first Ctrl-C instead (one line on stderr), and dlaunch stops where
nothing is half done: once the config is read and checked and torch is imported, just before Hydra runs
the job (``main._interrupted_before_start``; a subcommand, at once). From there Ctrl-C is Python's, and
then the run's own (torch elastic's, or the training loop's). A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Iterator

_noted: list[int] = []
_before: list[Any] = []  # the handler this replaced; empty: nothing replaced


def note_early() -> None:
    """From here on, the first Ctrl-C is noted rather than raised (not where Ctrl-C was ignored: ``nohup``)."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN or _before:
        return
    _before.append(previous)
    signal.signal(signal.SIGINT, _note)


def _note(signum: int, frame: Any) -> None:
    if _noted:
        raise KeyboardInterrupt  # asked twice: at once
    _noted.append(signum)
    print("dlaunch: Ctrl-C: stopping before training starts (again to stop at once)", file=sys.stderr, flush=True)


def requested() -> bool:
    """Whether a Ctrl-C came while it was noted."""
    return bool(_noted)


def hand_over() -> bool:
    """The previous Ctrl-C handling again, for the run to build on; whether a Ctrl-C came before."""
    if _before and signal.getsignal(signal.SIGINT) is _note:
        signal.signal(signal.SIGINT, _before.pop())
    return requested()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A Ctrl-C inside is raised (``KeyboardInterrupt``) once the block is done, so that the block is never left
    half done (a run's record half written); a second Ctrl-C at once. Where Ctrl-C is ignored, it stays ignored."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    came: list[int] = []

    def note(signum: int, frame: Any) -> None:
        if came:
            raise KeyboardInterrupt
        came.append(signum)

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if came:
        raise KeyboardInterrupt
