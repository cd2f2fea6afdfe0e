"""A Ctrl-C before the run's own signal handling: noted at once, acted on at the next safe point.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread is. In the first second of a
run that is mostly inside ``import torch``, whose C extension imports NumPy and swallows any error
that import raises (it goes on without NumPy support): a Ctrl-C there was lost, and the run trained to
its end. Elsewhere in those imports it printed a traceback from deep inside a library.

So the console script notes the first Ctrl-C instead (one line on stderr), and dlaunch stops where
nothing is half done: once the config is read and checked and torch is imported, just before Hydra runs
the job (``main._interrupted_before_start``; a subcommand, at once). From there Ctrl-C is Python's, and
then the run's own (torch elastic's, or the training loop's). A second Ctrl-C interrupts at once.

SIGTERM and SIGHUP are noted the same way, then raise ``Stopped`` until the run's own handling takes them: their
default action would end dlaunch without a word, wherever it was (verifying a large checkpoint before a resume,
say). A stop at any point after the start ends with a line that says so and exit 128 + N.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Iterator

from launcher.runtime.stop_signals import handling_stop_signals

_noted: list[int] = []
_before: dict[int, Any] = {}  # each signal's handler that this replaced; empty: nothing replaced


def note_early() -> None:
    """From here on, the first stop signal is noted rather than acted on: Ctrl-C (not where it was ignored: ``nohup``),
    and SIGTERM and SIGHUP where their default action would end dlaunch without a word."""
    if _before:
        return
    for sig in _STOPS:
        previous = signal.getsignal(sig)
        if previous is not signal.SIG_IGN and (sig == signal.SIGINT or previous is signal.SIG_DFL):
            _before[sig] = previous
            signal.signal(sig, _note)


def _note(signum: int, frame: Any) -> None:
    if _noted:
        _raise(signum)  # asked twice: at once
    _noted.append(signum)
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    print(f"dlaunch: {name}: stopping before training starts (again to stop at once)", file=sys.stderr, flush=True)


def requested() -> int:
    """The exit code of a stop signal that came while it was noted (128 + N), else 0."""
    return 128 + _noted[0] if _noted else 0


def hand_over() -> int:
    """Ctrl-C's previous handling again, for the run to build on; SIGTERM and SIGHUP raise ``Stopped`` from here until
    the run's own handling takes them (never their default action, which ends dlaunch without a word: as the run
    verifies its checkpoints, say). Returns ``requested()``: a stop that came before."""
    for sig in list(_before):
        if signal.getsignal(sig) is _note:
            signal.signal(sig, _before.pop(sig) if sig == signal.SIGINT else _stop)
    return requested()


def release() -> None:
    """SIGTERM and SIGHUP as they were before ``note_early``: dlaunch has ended its run and said how."""
    for sig, previous in list(_before.items()):
        if signal.getsignal(sig) in (_note, _stop):
            signal.signal(sig, _before.pop(sig))


def forget() -> None:
    """In a process forked from dlaunch that is not dlaunch (its forked warm server): every handler this replaced back
    as it was, nothing noted."""
    for sig, previous in list(_before.items()):
        signal.signal(sig, previous)
    _before.clear()
    _noted.clear()


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP where nothing else handles it (dlaunch itself, before its workers or its training loop take the
    signals over): raised as Ctrl-C's ``KeyboardInterrupt`` is, so the run stops with its summary and exit 128+N,
    not by the signal's default action (no word, no summary)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_OTHER_STOPS = (signal.SIGTERM, signal.SIGHUP)


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stops_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``Stopped`` inside (where their action is the default one, which kills)."""
    with handling_stop_signals(_stop, _OTHER_STOPS, replaces=lambda current: current is signal.SIG_DFL):
        yield


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) inside is raised once the block is done (``KeyboardInterrupt``,
    ``Stopped``), so that the block is never left half done (a run's record half written); a second one at once.
    A signal that is ignored stays ignored."""
    came: list[int] = []
    with _noting(came):
        yield
    if came:
        _raise(came[0])


_STOPS = (signal.SIGINT, *_OTHER_STOPS)


@contextlib.contextmanager
def _noting(came: list[int]) -> Iterator[Any]:
    """Inside, a stop signal is appended to ``came``, a second one raised at once; an ignored one stays ignored.
    Yields the handler."""

    def note(signum: int, frame: Any) -> None:
        if came:
            _raise(signum)
        came.append(signum)

    with handling_stop_signals(note, _STOPS, replaces=lambda current: current is not signal.SIG_IGN):
        yield note


def _raise(signum: int) -> None:
    raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)


class _Sweep:
    """A sweep whose jobs run in this process, while it is in ``between_jobs``."""

    came: list[int] = []  # the stop signal noted outside a job's own handling
    job_handlers: dict[int, Any] = {}  # what each job runs with: the handling from before the sweep
    note: Any = None


@contextlib.contextmanager
def between_jobs() -> Iterator[None]:
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) while Hydra sets a sweep's next job up or ends the sweep is noted:
    the next job is not started (``take_noted``) and the sweep ends with its table and resume hint, where the
    signal's default action ended dlaunch without a word. Each job takes the handling from before the sweep back
    once it launches (``job_launches``). A second signal stops at once. An ignored signal stays ignored."""
    came: list[int] = []
    before = {sig: signal.getsignal(sig) for sig in _STOPS}
    with _noting(came) as note:
        _Sweep.came, _Sweep.note = came, note
        _Sweep.job_handlers = {sig: h for sig, h in before.items() if h is not signal.SIG_IGN and signal.getsignal(sig) is note}
        try:
            yield
        finally:
            _Sweep.came, _Sweep.job_handlers, _Sweep.note = [], {}, None


def take_noted() -> int | None:
    """The stop signal noted between a sweep's jobs, once (None: none)."""
    return _Sweep.came.pop() if _Sweep.came else None


@contextlib.contextmanager
def job_launches() -> Iterator[None]:
    """A sweep's job from its launch on: the signal handling from before the sweep (the job's own takes over from
    there); the sweep's noting again afterwards, whatever the launch left (torch elastic keeps its handlers)."""
    if not _Sweep.job_handlers or threading.current_thread() is not threading.main_thread():
        yield
        return
    for sig, handler in _Sweep.job_handlers.items():
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig in _Sweep.job_handlers:
            signal.signal(sig, _Sweep.note)


def raise_noted() -> None:
    """A stop noted while a sweep's job got ready (its checkpoints verified, its plan shown): raised now, as one
    raised at this point would be."""
    signum = take_noted()
    if signum is not None:
        _raise(signum)
