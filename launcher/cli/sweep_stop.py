"""A stop signal to dlaunch while a sweep's jobs run in other processes (hydra/launcher=joblib, submitit_local,
submitit_slurm): the sweep ends as one whose jobs run in dlaunch's own process does, with its table and resume hint.

Hydra's basic launcher runs each job in dlaunch's process, which handles a stop itself (``interrupts.between_jobs``).
The others run each job in a process of theirs, and a signal to dlaunch ended dlaunch alone, without a word
(SIGTERM's default action), or was raised inside joblib, which then killed its workers in the middle of their jobs.
Now dlaunch notes the first stop signal (``noting``) and writes the sweep's stop marker: a job that starts after
it does not run (``not started``, ``stopped_before``). A job already running stops where the signal reached it too
(a terminal's Ctrl-C, ``timeout``'s, a scheduler's or ``kill -TERM -PGID`` go to every process of the group): it
saves and stops as any job does. One that the signal did not reach runs to its end; dlaunch does not send the
signal on, since a job that got it already would take a second one as "stop at once, without saving". Once
Hydra's launcher has every job back, the table, the resume hint and exit 128 + N follow. A second signal stops
dlaunch at once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path
from typing import Any, Iterator

from launcher.runtime import outputs
from launcher.runtime.stop_signals import STOP_SIGNALS, handling_stop_signals

MARKER = "sweep-stopped"  # SWEEP_DIR/.dlaunch/: why the sweep stopped, for the jobs that start after it


class _Parent:
    sweep_dir: Path | None = None  # set once the sweep starts (the sweep summary's on_multirun_start)
    came: list[int] = []


def started(sweep_dir: Path) -> None:
    """The sweep's directory is known (Hydra starts the sweep); an earlier command's marker goes."""
    _Parent.sweep_dir = sweep_dir
    (sweep_dir / outputs.STATE_DIR / MARKER).unlink(missing_ok=True)


def stopped_before(sweep_dir: Path) -> str | None:
    """Why a job of the sweep that starts now does not run (None: the sweep was not stopped)."""
    marker = sweep_dir / outputs.STATE_DIR / MARKER
    return marker.read_text().strip() if marker.is_file() else None


@contextlib.contextmanager
def noting() -> Iterator[None]:
    """dlaunch's handling of a stop signal while its sweep's jobs run elsewhere (see the module's docstring)."""
    from launcher.cli import interrupts

    def stop(signum: int, frame: Any) -> None:
        if _Parent.came or _Parent.sweep_dir is None:  # a second signal, or no job can have started: at once
            raise KeyboardInterrupt if signum == signal.SIGINT else interrupts.Stopped(signum)
        _Parent.came.append(signum)
        name = signal.Signals(signum).name
        state = _Parent.sweep_dir / outputs.STATE_DIR
        state.mkdir(parents=True, exist_ok=True)
        (state / MARKER).write_text(f"{name} came while the sweep's jobs ran\n")
        print(f"dlaunch: {'Ctrl-C' if signum == signal.SIGINT else name}: stopping the sweep: the jobs not started yet "
              "will not start; a running job stops (and saves) where the signal reached it too (a terminal's Ctrl-C, "
              "a signal to the process group, the scheduler's), else it runs to its end (again to stop at once)",
              file=sys.stderr, flush=True)

    _Parent.sweep_dir, _Parent.came = None, []
    try:
        with handling_stop_signals(stop, STOP_SIGNALS, replaces=lambda current: current is not signal.SIG_IGN):
            yield
    finally:
        _Parent.sweep_dir, _Parent.came = None, []


def raise_taken() -> None:
    """A stop noted while a job of the sweep got ready in dlaunch's own process (joblib runs its jobs here with
    n_jobs=1): raised once the job's record is whole, as ``interrupts.raise_noted`` does for the basic launcher's."""
    if _Parent.came:
        from launcher.cli import interrupts

        raise KeyboardInterrupt if _Parent.came[0] == signal.SIGINT else interrupts.Stopped(_Parent.came[0])


def taken() -> int | None:
    """The stop signal that stopped the sweep (None: none), inside ``noting``."""
    return _Parent.came[0] if _Parent.came else None
