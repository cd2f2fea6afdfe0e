"""Stopping on SIGTERM, SIGINT or SIGHUP at a step every rank agrees on.

A preempted job gets a signal, then a grace period before SIGKILL. Each rank's
handler only sets a flag; after every step the ranks combine their flags with
a MAX all-reduce on a small gloo group, started asynchronously and read one
step later, so it overlaps with training and every rank reads the same value
after the same step; after a step that evaluated or saved (a signal may have come
during them), it is read at once. Then each rank saves its part of a checkpoint (when
checkpoints are on) and leaves with ``128 + signal``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from launcher.runtime.stop_signals import STOP_SIGNALS

log = logging.getLogger("dlaunch")


class Preempted(Exception):
    """Training stopped early because of a signal; the exit code is ``128 + signum``."""

    explained = True

    def __init__(self, signum: int, step: int | None, checkpoint: Any = None, saved_elsewhere: str = "",
                 unsaved: str = "", in_step: bool = False):
        """``saved_elsewhere``: who saves instead of this process (a parameter-server worker's chief). ``unsaved``:
        why the stop's checkpoint was not saved (the storage refused it, ``trainer.checkpoint.on_error=warn``).
        ``in_step``: stopped inside step ``step + 1``, the command's first, before it completed: nothing to save,
        and the ranks stopped wherever the signal found each, not at one agreed point (as a script's do)."""
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.agreed = not in_step and step is not None  # the ranks stopped after the same step: they may meet to leave
        if in_step:
            super().__init__(f"stopped by {self.signal_name} in step {step + 1}, before it completed: nothing new to save")
            return
        saved = (saved_elsewhere or (f"checkpoint {checkpoint}" if checkpoint else unsaved)
                 or "no checkpoint (trainer.checkpoint.every_steps is 0)")
        super().__init__(f"stopped by {self.signal_name} after step {step}; {saved}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class StoppedEarly(KeyboardInterrupt):
    """A stop signal before the first step of this command completed: nothing new to save, so the rank stops at once
    (a first step that compiles can take minutes) rather than at the step's end."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StopRequests:
    """Signal flags, agreed across ranks one step late (at once after an evaluation or a save).

    ``force_on_repeat``: a second signal raises ``KeyboardInterrupt`` at once (an
    impatient Ctrl-C in a single process). Workers keep it off: they receive
    both the terminal's Ctrl-C and the elastic agent's forwarded copy.
    """

    def __init__(self, distributed: bool, force_on_repeat: bool = False, elsewhere: Callable[[], int] = lambda: 0,
                 saves: bool = True, torn_down: Callable[[], bool] = lambda: False):
        """``elsewhere``: a signal another process of the job stopped on, to stop on as if received here.
        ``saves``: a checkpoint is saved at the stop (checkpoints are on). ``torn_down``: the signal came from this
        rank's agent, stopping it for a failure that dlaunch reports (no stop to announce)."""
        self.signum, self._saves, self._torn_down = 0, saves, torn_down
        self._at_once, self._during = False, ""
        self._force, self._elsewhere = force_on_repeat, elsewhere
        self._group = dist.new_group(backend="gloo") if distributed else None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._previous: dict[int, Any] = {}
        self._pid = os.getpid()

    def __enter__(self) -> "StopRequests":
        self._pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handler) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        try:
            self.settle()
        except Exception:  # noqa: BLE001 - a peer is gone; the real error is reported elsewhere
            pass
        self._pending = None

    def _handler(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a process forked inside (a loader's worker): its rank stops it, once stopped
            if signum == signal.SIGTERM:  # the way a rank (or Process.terminate) stops it: as if never handled here
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if self.signum and self._force:
            raise KeyboardInterrupt
        if self._at_once and not self.signum and not self._torn_down():
            self.signum = signum
            log.warning("%s received before this command's first step completed: the ranks stop now, with nothing new "
                        "to save", signal.Signals(signum).name)
            raise StoppedEarly(signum)
        first, self.signum = not self.signum, self.signum or signum
        if first:  # set before the log: a second signal (the terminal's SIGINT, then the agent's SIGTERM) arriving
            # inside this log call logs nothing, rather than re-enter the log file's writer (a "Logging error")
            name = signal.Signals(signum).name
            if self._torn_down():
                log.debug("%s from this rank's agent: the job is torn down after a failure", name)
            else:
                log.warning("%s received: %sthe ranks stop together within a step, %s", name,
                            f"{self._during} finishes first, then " if self._during else "",
                            "then save" if self._saves else "and save nothing (checkpoints are off)")

    @contextlib.contextmanager
    def at_once_inside(self, armed: bool) -> Iterator[None]:
        """A first signal inside raises ``StoppedEarly`` (``armed``: the command's first step, not its last): that
        step, a compile maybe minutes long, has nothing to save yet. Its evaluation and checkpoint after it wait for a
        stop as every step's do (a save in flight is never cut short from here)."""
        self._at_once = armed
        try:
            yield
        finally:
            self._at_once = False

    def settle(self) -> None:
        """Wait for the agreement launched after the last step (``agreed`` reads it as before): none runs on."""
        if self._pending is not None:
            self._pending[0].wait()

    def agreed(self, now: bool = False) -> int:
        """After a step: the signal every rank stops for (0: go on). ``now`` (every rank alike: after an evaluation
        or a save, which a signal may have come during): the flags as they are now, not one step late, so that a
        stop during a long evaluation does not train one more step and save again right after the step's save."""
        if self._group is None:
            self.signum = self.signum or self._elsewhere()
            return self.signum
        result = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            result, self._pending = int(flag.item()), None
        flag = torch.tensor([self.signum], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        if now:
            work.wait()
            return result or int(flag.item())
        self._pending = (work, flag)
        return result

    @contextlib.contextmanager
    def during(self, what: str) -> Iterator[None]:
        """A first signal inside says that ``what`` (an evaluation, a save) finishes first: it may take a while."""
        self._during = what
        try:
            yield
        finally:
            self._during = ""
