"""Root causes: which rank failed first, with what, and where.

Workers write their exception to the error file the elastic agent gives them
(plus dlaunch's precise time, host and pid); the launcher shows the first one
once, and a line for every other rank.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import runpy
import signal
import site
import socket
import sys
import sysconfig
import time
import traceback
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel

from launcher.runtime import outputs
from launcher.runtime.heartbeat import CollectiveTimeout


@dataclasses.dataclass(frozen=True)
class RootCause:
    rank: int
    host: str
    pid: int
    exit: str  # "exit code 1", "signal SIGKILL"
    exception: str  # "ValueError: boom" or "" when the process died without one
    traceback: str
    time: float
    last_step: int | None = None  # the rank's last completed step, when it said or its heartbeat did
    task: str = ""  # a parameter-server job's task (chief:0, worker:1, ps:0); empty otherwise
    stopped_by: str = ""  # "SIGTERM": the rank stopped on that signal, after its save (dlaunch's Preempted)
    ends_run: bool = False  # a failure no restart may follow (a stop signal whose save was refused)
    script_exit: int | None = None  # a script's own sys.exit code: dlaunch exits with it, as python would

    @property
    def exit_status(self) -> int:
        """What dlaunch exits with when this is the root cause."""
        return self.script_exit or 1

    @property
    def who(self) -> str:
        return f"task {self.task}" if self.task else f"rank {self.rank}"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# torch's own advice, said in dlaunch's terms: (what torch's message says, the note added under it)
_ADVICE = (
    ("find_unused_parameters=True", "dlaunch: set strategy.find_unused_parameters=true (DDP's find_unused_parameters), "
                                    "or make every parameter take part in the loss"),
)


def advise(exc: BaseException) -> BaseException:
    """``exc`` with a note naming dlaunch's setting where torch's message names a torch argument."""
    for found, note in _ADVICE:
        if found in str(exc) and note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)
    return exc


def write_error_file(path: str | None, exc: BaseException, rank: int, extra: dict[str, Any] | None = None) -> None:
    """Record ``exc`` where the elastic agent looks (its format, plus dlaunch's fields and ``extra``)."""
    advise(exc)
    if not path:  # not under an elastic agent: nobody else will show it
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": _format(exc), "timestamp": str(int(time.time()))},
        },
        "dlaunch": {**(extra or {}), **_script_exit(exc), "rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()},
    }
    try:
        outputs.write_json_atomic(Path(path), data)  # the agent parses it: never an empty or half-written file
    except OSError as err:  # a full or read-only disk: the cause still reaches the terminal, from this rank
        print(f"dlaunch: rank {rank} could not record its error in {path} ({err}); it was:", file=sys.stderr, flush=True)
        traceback.print_exception(type(exc), exc, exc.__traceback__)


def from_exception(exc: BaseException, rank: int = 0, last_step: int | None = None) -> RootCause:
    advise(exc)
    return RootCause(rank, socket.gethostname(), os.getpid(), "exception", f"{type(exc).__name__}: {exc}", _format(exc),
                     time.time(), last_step, **_script_exit(exc))


def exit_status(exc: BaseException) -> int:
    """The exit code a failing process ends with: 1, or a script's own ``sys.exit`` code."""
    return _script_exit(exc).get("script_exit") or 1


def _script_exit(exc: BaseException) -> dict[str, int]:
    code = getattr(exc, "script_exit_code", None)  # launcher.runtime.script.ScriptExit's
    return {"script_exit": code} if isinstance(code, int) else {}


#: each worker's stderr log where it has one (the ranks the terminal does not show: torch elastic's tee), and each
#: one's fault log (``fault_log``), by global rank, as this process's agent last started them (``agent.Agent._start_workers``)
STDERR_LOGS: dict[int, str] = {}
FAULT_LOGS: dict[int, str] = {}


def fault_log(error_file: str | None) -> Path | None:
    """Where a worker's faulthandler writes a native crash's stack: beside its error file (None: it has none). Rank 0's
    stderr is the terminal, which dlaunch cannot read back; every rank's stack reaches its root cause from here."""
    return Path(error_file).with_name("fault.log") if error_file and error_file != os.devnull else None

CLEAN_EXIT = "exit code 0"  # a worker that ended without an error: completed, or left the others early


def from_process_failure(rank: int, failure: Any) -> RootCause:
    """A ``ProcessFailure`` from torch.distributed.elastic as a ``RootCause``."""
    data = failure.error_file_data or {}
    message = data.get("message", {}) if isinstance(data.get("message"), dict) else {}
    extra = data.get("dlaunch", {})
    exception, stack = message.get("message", ""), message.get("extraInfo", {}).get("py_callstack", "")
    if not exception and -(failure.exitcode or 0) in _CRASHES:
        exception, stack = native_crash(*(Path(logs[rank]) for logs in (STDERR_LOGS, FAULT_LOGS) if logs.get(rank)))
    own_exit = not exception and 0 < (failure.exitcode or 0) < 128  # os._exit(N): no error file, no exception
    if own_exit:
        exception = (f"the process ended itself with exit code {failure.exitcode} and no Python exception "
                     "(os._exit(), or exit() in native code)")
    return RootCause(
        rank=rank,
        host=extra.get("host", socket.gethostname()),
        pid=failure.pid or extra.get("pid", 0),
        exit=_exit_text(failure.exitcode),
        exception=exception,
        traceback=stack,
        time=float(extra.get("time", failure.timestamp)),
        last_step=extra.get("last_step"),
        stopped_by=str(extra.get("stopped_by", "")),
        ends_run=bool(extra.get("ends_run", False)),
        script_exit=extra.get("script_exit", failure.exitcode if own_exit else None),  # dlaunch exits with it too
    )


# Signals a process ends with by itself (a C++ exception nothing caught, NCCL's watchdog, a bad pointer): no Python
# exception reaches the error file, but its last words and faulthandler's stack are in its stderr.
_CRASHES = {int(s) for s in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)}
_WHAT = re.compile(r"terminate called after throwing an instance of '([^']+)'\s*\n\s*what\(\):\s*(.*)")
_ENFORCE = re.compile(r"\[enforce fail at [^\]]+\] ")  # gloo's
_FATAL = re.compile(r"^Fatal Python error: (.*)$", re.M)
_FAULT_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):$")


def native_crash(*logs: Path, tail_bytes: int = 1 << 18) -> tuple[str, str]:
    """(what a rank that died by a signal said last, faulthandler's stack of it as a traceback) from its logs (its
    stderr log, then its fault log): the C++ exception's type and first line (gloo's ``Is there a distributed
    collective mismatch in your code?``, NCCL's watchdog timeout), else Python's ``Fatal Python error: Segmentation
    fault``. ("", "") where none is there."""
    text = "\n".join(_tail(log, tail_bytes) for log in logs)
    thrown, fatal = list(_WHAT.finditer(text)), list(_FATAL.finditer(text))
    if thrown:
        exception = f"{thrown[-1].group(1)}: {_ENFORCE.sub('', _SOURCE.sub('', thrown[-1].group(2))).strip()}"
    elif fatal:
        exception = f"Fatal Python error: {fatal[-1].group(1).strip()}"
    else:
        return "", ""
    frames = _crashed_thread(text[fatal[-1].end():]) if fatal else []
    # the frames inside dlaunch's innermost one: the rank's own code and what it called (a Python traceback's part)
    inner = max((i for i, frame in enumerate(frames) if _is_dlaunch_frame(frame[0])), default=-1)
    stack = "".join(f'  File "{path}", line {line}, in {name}\n' for path, line, name in frames[inner + 1:] or frames)
    return exception, f"Stack (most recent call last), from faulthandler:\n{stack}" if stack else ""


def _tail(log: Path, size: int) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _crashed_thread(dump: str) -> list[tuple[str, str, str]]:
    """The frames (outermost first) of the thread faulthandler's dump says crashed (``Current thread``); where a
    thread Python does not know aborted (gloo's, NCCL's watchdog), the one that ran the rank's own code, else the
    main thread (listed last). dlaunch's heartbeat thread is never the answer unless it is the only one."""
    blocks: list[tuple[bool, list[tuple[str, str, str]]]] = []
    for line in dump.lstrip("\n").splitlines()[:2000]:
        if (header := _THREAD.match(line)) is not None:
            blocks.append((header.group(1) == "Current thread", []))
        elif (frame := _FAULT_FRAME.match(line)) is not None and blocks:
            blocks[-1][1].insert(0, frame.groups())
        elif line.strip() and not line.startswith("  <"):  # the dump ends (Extension modules: ..., the next output)
            break
    current = [frames for is_current, frames in blocks if is_current]
    own = [frames for _, frames in reversed(blocks) if any(not _is_dlaunch_frame(f) and not f.startswith(("<", *_LIBRARIES))
                                                            for f, _, _ in frames)]
    return (current or own or [frames for _, frames in blocks[-1:]] or [[]])[0]


# What a rank says when it failed only because a peer died first.
_CONSEQUENCES = ("Connection reset by peer", "Connection closed by peer", "Socket closed", "NCCL communicator was aborted",
                 "ProcessGroupGloo", "Broken pipe", "ParameterServerUnavailable: ", "shared-memory all-reduce: rank ")


def is_a_stop(causes: list[RootCause]) -> bool:
    """Ranks that a signal sent to them (not to dlaunch) stopped after their save, beside ranks that failed only on
    losing a stopped peer (one rank stopped at once in its first step, another had just passed it): a stop."""
    return any(c.stopped_by for c in causes) and all(is_consequence(c) for c in causes)


def restarts_after(causes: list[RootCause]) -> bool:
    """Whether ``launch.max_restarts`` may restart workers that ended so: not after a stop, nor a stop's failed save."""
    return bool(causes) and not is_a_stop(causes) and not any(c.ends_run for c in causes)


def is_consequence(cause: RootCause) -> bool:
    """A rank stopped by dlaunch, or one whose collective broke because a peer had gone.

    A collective that timed out is a cause: its message names the rank that never came. A rank that stopped on a
    signal (after its save) is not the cause of another's failure.
    """
    if cause.stopped_by:
        return True
    if not cause.exception:
        return cause.exit == "signal SIGTERM"
    if cause.exception.startswith(f"{CollectiveTimeout.__name__}:"):
        return False
    return _peer_gone(cause.exception)


def _peer_gone(exception: str) -> bool:
    return any(marker in exception for marker in _CONSEQUENCES)


def waited_on_a_peer(cause: RootCause) -> bool:
    """The rank failed waiting for another: a collective that timed out, or whose peer closed its connection."""
    timed_out = "Timed out" in cause.exception or cause.exception.startswith(f"{CollectiveTimeout.__name__}:")
    return timed_out or _peer_gone(cause.exception)


def first(causes: list[RootCause]) -> RootCause:
    """The earliest failure that is not a consequence of another (a killed rank counts as a cause)."""
    causes_only = [c for c in causes if not is_consequence(c)] or causes
    earliest = min(causes_only, key=lambda c: c.time)
    # Ranks that failed with one message (a check every rank makes, as of recipe.features against the first input
    # file) raced to be first: the lowest of them is named, whose message it is (rank 0 reads the first file).
    same = [c for c in causes_only if c.exception and c.exception == earliest.exception]
    return min(same, key=lambda c: c.rank) if same else earliest


def render(root: RootCause, others: list[RootCause], last_logged: int | None, console: Console | None = None) -> None:
    """The root cause in one panel (its last completed step, else the last logged one), then a line per other rank."""
    if console is None:
        from launcher.cli import output  # where dlaunch's messages go: off a terminal, plain and unwrapped

        console = output.messages()
    lines = [
        f"[bold]{'task' if root.task else 'rank'}[/] {root.task or root.rank}   [bold]host[/] {escape(root.host)}   [bold]pid[/] {root.pid}   {root.exit}",
    ]
    if root.last_step is not None:
        lines.append(f"[bold]last completed step[/] {root.last_step}")
    elif last_logged is not None:
        lines.append(f"[bold]last logged step[/] {last_logged}")
    if root.exception:
        lines.append(f"[bold red]{escape(root.exception)}[/]")
    body = "\n".join(lines)
    if root.traceback:
        body += "\n\n" + escape(root.traceback.rstrip())
    title = f"[bold red]{'' if root.task else 'worker '}{root.who} failed: root cause[/]"
    if console.is_terminal:
        console.print(Panel(body, title=title, border_style="red", expand=False))
    else:  # a log file (a scheduler's, error.txt): no box padding every line to the longest one
        console.print(title + "\n" + "\n".join(f"  {line}" if line else "" for line in body.split("\n")))
    for other in sorted(others, key=lambda c: c.rank):
        what = f": {escape(_one_line(_SOURCE.sub('', other.exception)))}{_where(other.traceback)}" \
            if other.exception else " (stopped by dlaunch)"
        if other.exception and other.exception == root.exception:  # not the message again, as if it were its own
            what = f": the same {escape(root.exception.split(':', 1)[0])} as {root.who}"
        console.print(f"  {other.who}: {other.exit}{what}")


def as_text(root: RootCause, others: list[RootCause], last_logged: int | None) -> str:
    """What ``render`` shows, as plain text (no colour): the block a failed run's directory keeps, each line whole
    (a file is not wrapped at a terminal's width)."""
    buffer = io.StringIO()
    render(root, others, last_logged, Console(emoji=False, file=buffer, color_system=None, highlight=False, soft_wrap=True))
    return buffer.getvalue()


_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)
_RECIPES_DIR = str(Path(_PACKAGE_DIR) / "recipes")  # shipped recipes are user-level code
_RUNPY = (runpy.__file__, "<frozen runpy>")


_SOURCE = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp|cu):\d+\] ")  # gloo's "[/__w/.../unbound_buffer.cc:78] "
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_LIBRARIES = (*(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")), *site.getsitepackages(),
              site.getusersitepackages(), "/usr/lib/python3/dist-packages")  # Debian's: torch, numpy


def _where(traceback_text: str) -> str:
    """`` (at train.py:23)``: the innermost frame of the rank's own code, not torch's or Python's (none: "")."""
    own = [(f, line) for f, line in _FRAME.findall(traceback_text)
           if not f.startswith(("<", *_LIBRARIES)) and not _is_dlaunch_frame(f)]
    return f" (at {Path(own[-1][0]).name}:{own[-1][1]})" if own else ""


def _one_line(text: str, limit: int = 110) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _is_dlaunch_frame(filename: str) -> bool:
    if filename in _RUNPY:  # how script mode runs the user's script: not the user's code
        return True
    return filename.startswith(_PACKAGE_DIR) and not filename.startswith(_RECIPES_DIR)


_MODULE_CALLS = {("nn/modules/module.py", "_wrapped_call_impl"), ("nn/modules/module.py", "_call_impl"),
                 ("nn/modules/module.py", "inner"),  # _call_impl's own, where a module has hooks
                 ("nn/parallel/distributed.py", "forward"), ("nn/parallel/distributed.py", "_run_ddp_forward"),
                 ("_tensor.py", "backward"), ("autograd/__init__.py", "backward")}  # loss.backward() on to the engine


def _module_call(frame: traceback.FrameSummary) -> bool:
    """A frame of torch's that only passes a call on to a module's ``forward`` (``model(x)`` through ``__call__``,
    DDP's ``forward``): between the user's frames it says nothing. The frame an error was raised in is never one."""
    path = frame.filename.replace("\\", "/")
    return "/torch/" in path and any(path.endswith(f) and frame.name == name for f, name in _MODULE_CALLS)


def _format(exc: BaseException) -> str:
    """The traceback without dlaunch's own frames (all of it if the error is dlaunch's own).

    An exception whose class sets ``explained = True`` says all there is to say: no traceback.
    """
    if getattr(exc, "explained", False):
        return ""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for i, f in enumerate(frames)
            if not _is_dlaunch_frame(f.filename) and not (i < len(frames) - 1 and _module_call(f))]
    shown = traceback.StackSummary.from_list(user or frames)
    note = ["  (dlaunch's own frames and torch's module calls are hidden)\n"] if user and len(user) < len(frames) else []
    lines = ["Traceback (most recent call last):\n", *note, *shown.format()]
    return "".join(lines + traceback.format_exception_only(type(exc), exc))


def _exit_text(code: int | None) -> str:
    if code is None:
        return "unknown"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
