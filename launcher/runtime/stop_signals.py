"""The stop signals (SIGTERM, SIGINT, SIGHUP), and how every part of dlaunch handles them for a block.

dlaunch takes them over in several places: the console script before torch is imported
(``cli/interrupts.py``), dlaunch while the nodes meet (``launch/elastic.py``), the emulated nodes'
parent (``launch/emulate.py``), a worker's script or parameter-server task (``runtime/``). Each sets
its handler for a block and puts the previous ones back, so this is written once. It imports nothing
heavy: ``cli/interrupts.py`` uses it before ``import torch``, where a Ctrl-C would be lost.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _any_handler(current: Any) -> bool:
    return True


@contextlib.contextmanager
def handling_stop_signals(handler: Callable[[int, Any], None], signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
                          replaces: Callable[[Any], bool] = _any_handler) -> Iterator[None]:
    """``handler`` for ``signals`` while inside, the previous handlers afterwards.

    ``replaces(current)`` says which handlers give way (``lambda h: h is signal.SIG_DFL``: only where nothing
    else handles the signal); the others stay. Off the main thread, where Python lets no code set a handler
    (``ValueError``), it sets none: the block runs as it would without this.

        with handling_stop_signals(stop, (signal.SIGTERM, signal.SIGHUP)):
            ...
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals if replaces(signal.getsignal(sig))}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _let_go(signum: int, frame: Any) -> None:
    """A stop signal once the run has stopped: nothing more to do."""


@contextlib.contextmanager
def closing() -> Iterator[None]:
    """The run has stopped and says how (its summary, its last lines): a further stop signal inside is let go.
    Raised, it would cut the summary off half written and print a traceback from dlaunch's own code (a second
    Ctrl-C, pressed as the workers started). The block is short, and after it the signals are as they were."""
    with handling_stop_signals(_let_go):
        yield


@contextlib.contextmanager
def cut_short() -> Iterator[None]:
    """Tidying after the run ended and said how: one more stop signal (``KeyboardInterrupt``, or the
    ``SignalException`` of torch elastic's handler, matched by name: nothing heavy is imported here) ends the block
    quietly; the run's exit code stands. Any other error still raises."""
    try:
        yield
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is torch elastic's stop
        if type(exc).__name__ != "SignalException":
            raise
