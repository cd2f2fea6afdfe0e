"""Rank 0's view of training: a rich progress bar on a terminal, log lines elsewhere."""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

log = logging.getLogger("dlaunch")


def setup_logging(rank: int, console: Console, who: str | None = None) -> None:
    """INFO from rank 0 only; warnings and errors from every rank, in one format: ``LEVEL message``.

    A worker's lines are tagged by its elastic agent (``[rank1] WARNING ...``, every rank but rank 0
    of node 0), so a worker adds no tag of its own. A process that no agent tags (an emulated node's
    agent) passes ``who``: its lines read ``[node1] WARNING ...``.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(console_handler(console, f"[{who}{rank}] " if who and rank else ""))
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


_TORCH_RANK = re.compile(r"^\[rank\d+\]:", re.MULTILINE)


class _WithoutTorchRank(logging.Formatter):
    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return _TORCH_RANK.sub("", self.inner.format(record))


def untag_torch_logs() -> None:
    """torch's own log lines (torch.compile's recompile warning) start with ``[rankN]:`` once a process group exists,
    and the agent tags a worker's lines already: ``[rank1] [rank1]:W1201 ...``. Drop torch's tag from the handlers
    torch set up as it loaded, and from those it sets up again (``torch._logging.set_logs``, ``TORCH_LOGS``) through its
    default formatter (private: where a torch has none by that name, only the first)."""
    import sys

    internal = sys.modules.get("torch._logging._internal")
    default = getattr(internal, "DEFAULT_FORMATTER", None)
    if isinstance(default, logging.Formatter) and not isinstance(default, _WithoutTorchRank):
        internal.DEFAULT_FORMATTER = _WithoutTorchRank(default)
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.partition(".")[0] == "torch" and isinstance(logger, logging.Logger):
            for handler in logger.handlers:
                if type(handler.formatter).__name__ == "TorchLogsFormatter":
                    handler.setFormatter(_WithoutTorchRank(handler.formatter))


FILE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - {tag}%(message)s"  # conf/hydra/job_logging/dlaunch.yaml's


def launcher_log() -> str | None:
    """The file the launcher logs to (Hydra's ``RUN_DIR/dlaunch.log``), for its workers to append to; None: no file."""
    handler = next((h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)), None)
    return handler.baseFilename if handler else None


def log_to_file(path: str | None, rank: int, who: str = "rank") -> None:
    """Append this process's lines to the launcher's log file too, in its format (``[rankN]`` for all but rank 0; an
    emulated node's or a task's agent: ``[nodeN]``): the run directory keeps rank 0's progress and every rank's
    warnings, not only the terminal."""
    if not path:
        return
    try:
        handler = logging.FileHandler(path, mode="a", delay=True)
    except OSError:  # the terminal and logs/ still have the lines
        return
    handler.setFormatter(logging.Formatter(FILE_FORMAT.format(tag=f"[{who}{rank}] " if rank or who != "rank" else "")))
    logging.getLogger().addHandler(handler)


def file_only(level: int, text: str) -> None:
    """``text`` into the launcher's log file alone: what the terminal already showed in a panel (a root cause)."""
    record = logging.LogRecord(log.name, level, __file__, 0, "%s", (text,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def console_handler(console: Console, tag: str = "") -> logging.Handler:
    """Rich on a terminal; off one (a file, a pipe) plain ``LEVEL message`` lines, unpadded and unwrapped."""
    if console.is_terminal:
        handler: logging.Handler = RichHandler(console=console, show_path=False, show_time=False)
        handler.setFormatter(logging.Formatter(f"{tag}%(message)s"))
    else:
        handler = logging.StreamHandler(console.file)
        handler.setFormatter(logging.Formatter(f"{tag}%(levelname)s %(message)s"))
    return handler


class _Tagged(logging.Formatter):
    """Another formatter's line with ``tag`` before it."""

    def __init__(self, tag: str, inner: logging.Formatter | None):
        super().__init__()
        self.tag, self.inner = tag, inner.inner if isinstance(inner, _Tagged) else inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return self.tag + self.inner.format(record)


_console_tag = {"tag": ""}  # this process's, for the workers it launches


def tag_console_lines(tag: str) -> None:
    """Start each line this process logs to the terminal with ``tag`` (``[job 3] ``): a sweep's jobs that joblib runs
    side by side write to one terminal. The log file (the job's own) stays as it is; workers launched from here are
    given the tag (``console_tag``)."""
    _console_tag["tag"] = tag
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RichHandler) or type(handler) is logging.StreamHandler:
            handler.setFormatter(_Tagged(tag, handler.formatter))


def console_tag() -> str:
    return _console_tag["tag"]


class ProgressReporter:
    """Shows step, loss, examples/s and ETA."""

    def __init__(self, total_steps: int, enabled: bool, console: Console, start: int = 0):
        self.total = total_steps
        self.enabled = enabled
        self._bar: Progress | None = None
        if enabled and console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}{task.fields[own]}"),
                TextColumn("{task.fields[speed]} ex/s"),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, completed=start, loss="-", speed="-", own="")
            self._bar.start()

    def advance(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step)

    def logged(self, step: int, loss: float, examples_per_sec: float, eta_s: float | None,
               own: dict[str, float] | None = None) -> None:
        """``eta_s`` None: no step since the first has ended, and the first (compile, warm-up) predicts nothing.
        ``own``: the metrics the recipe's step returns beside its loss, shown after it."""
        if not self.enabled:
            return
        beside = "".join(f"  {name} {value:.6g}" for name, value in (own or {}).items())
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.4g}", speed=f"{examples_per_sec:,.0f}",
                             own="".join(f"  {name} {value:.4g}" for name, value in (own or {}).items()))
        elif eta_s is None:
            log.info("step %d/%d  loss %.6g%s  %.0f ex/s", step, self.total, loss, beside, examples_per_sec)
        else:
            log.info("step %d/%d  loss %.6g%s  %.0f ex/s  eta %.0fs", step, self.total, loss, beside, examples_per_sec, eta_s)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class Meter:
    """Throughput between log points (steps x the rows of ``stream``'s global batches) and the time left.

    ``step_seconds``: the wall time of each step this command has finished (the loop's list). The time left goes
    by the steps after the first: a first step that compiled the model for a minute predicts nothing. ``aside``: the
    seconds spent so far outside training (evaluations, checkpoint saves), which the throughput leaves out: an
    evaluation that compiles its own graph would otherwise read as a slow training step. The time left counts them.
    """

    def __init__(self, stream: Any, total_steps: int, first_step: int = 0, step_seconds: list[float] | None = None,
                 aside: Callable[[], float] = lambda: 0.0):
        self.stream, self.total, self.aside = stream, total_steps, aside
        self.mark, self.mark_aside = time.perf_counter(), aside()
        self.mark_step = first_step  # the examples/s window starts after it
        self.step_seconds = step_seconds if step_seconds is not None else []
        self._warm, self._summed = 0.0, 1  # the seconds of steps 2.. summed so far, and up to which index

    def window(self, step: int) -> tuple[float, float | None]:
        now, aside = time.perf_counter(), self.aside()
        trained = now - self.mark - (aside - self.mark_aside)
        rate = (step - self.mark_step) * (self.stream.rows_per_batch or 0) / max(trained, 1e-9)
        self.mark, self.mark_aside, self.mark_step = now, aside, step
        ended = len(self.step_seconds)  # the step being logged has not ended: it is not in the list yet
        if ended > self._summed:  # only what ended since the last log: a long run's logs stay cheap
            self._warm += sum(self.step_seconds[self._summed:ended])
            self._summed = ended
        if ended < 2:
            return rate, None
        return rate, self._warm / (ended - 1) * (self.total - step)
