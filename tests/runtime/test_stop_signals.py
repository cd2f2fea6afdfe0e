"""The one way dlaunch handles stop signals for a block: which handlers give way, and what comes back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from launcher.runtime.stop_signals import STOP_SIGNALS, closing, handling_stop_signals


class _Caught(Exception):
    pass


def _raise(signum: int, frame: object) -> None:
    raise _Caught(signum)


def test_the_handler_raises_inside_and_the_previous_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with pytest.raises(_Caught):
        with handling_stop_signals(_raise):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_a_stop_signal_while_a_stopped_run_closes_is_let_go_and_the_handlers_come_back():
    """A second Ctrl-C as a stopped run wrote its summary cut the summary off and printed a traceback."""
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    done = []
    with handling_stop_signals(_raise):
        with closing():
            for sig in STOP_SIGNALS:
                os.kill(os.getpid(), sig)
                time.sleep(0.05)
            done.append("the summary")
        with pytest.raises(_Caught):  # after the block, as before it
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert done == ["the summary"] and {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_only_the_handlers_replaces_accepts_give_way():
    mine = lambda signum, frame: None  # noqa: E731 - a handler someone else set
    previous, previous_term = signal.signal(signal.SIGHUP, mine), signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with handling_stop_signals(_raise, (signal.SIGTERM, signal.SIGHUP), replaces=lambda h: h is signal.SIG_DFL):
            assert signal.getsignal(signal.SIGTERM) is _raise
            assert signal.getsignal(signal.SIGHUP) is mine
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:  # an earlier test of this process (torch elastic's) may have set SIGTERM's handler: it comes back
        signal.signal(signal.SIGHUP, previous)
        signal.signal(signal.SIGTERM, previous_term)


def test_off_the_main_thread_it_sets_nothing_rather_than_fail():
    seen = []

    def block() -> None:
        with handling_stop_signals(_raise):
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=block)
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGTERM)] and seen[0] is not _raise


def test_importing_it_imports_no_torch():
    """``cli/interrupts.py`` uses it before ``import torch``, where a Ctrl-C is only noted."""
    code = "import sys; import launcher.runtime.stop_signals; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
