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
