"""A worker process: ``python -m launcher.runtime.worker_entry RUN_DIR/.dlaunch/job.json`` runs ``main``.

Started by the elastic agent, one per device. It reads the validated spec (no
Hydra here), trains, marks its rank complete, tears the process group down
and leaves with ``os._exit`` so that no C++ destructor running at interpreter
exit (gloo's, notably) can turn a completed run into a crash.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from launcher.cluster import env as env_lib
from launcher.cluster import preflight
from launcher.cluster.process_group import leave_group
from launcher.config.plan import Plan, read_job
from launcher.config.schema import RunSpec
from launcher.launch.failures import exit_status, fault_log, write_error_file
from launcher.launch.parent_death import die_with_parent
from launcher.runtime import heartbeat, outputs
from launcher.runtime.loop import train
from launcher.runtime.preemption import Preempted
from launcher.runtime.progress import log, log_to_file, setup_logging, tag_console_lines, untag_torch_logs
from launcher.runtime.stop_signals import cut_short
from launcher.runtime.streams import reader_may_leave


# A failure's or a stop's exception, kept until the process leaves with os._exit. Freeing it frees its traceback's
# frames: a script's DDP model whose gradient all-reduce a signal interrupted then destroys its gloo group while
# holding the GIL, and the group's thread, finishing that all-reduce, waits for the GIL (a deadlock inside torch).
_UNFREED: list[BaseException] = []
_FAULT_LOG: list = []  # the open fault log faulthandler writes to: open until the process ends


def die_with_launcher() -> None:
    """If dlaunch itself is killed (SIGKILL, OOM), its workers (and agents) must not train on as orphans; and
    ``dlaunch ... | head`` must not end them (``streams``)."""
    die_with_parent()
    reader_may_leave()


def record_native_crashes() -> None:
    """A native crash's stack (faulthandler's dump: a segfault, a C++ abort) goes to this rank's fault log, where its
    root cause finds it (``failures.fault_log``), not to its stderr: rank 0's is the terminal, which dlaunch cannot read
    back, and the dump's 40 lines there came before the root cause that shows its stack once."""
    path = fault_log(env_lib.error_file())
    if path is None:
        return
    try:
        _FAULT_LOG.append(open(path, "w"))  # noqa: SIM115 - kept open for faulthandler
    except OSError:
        return
    faulthandler.enable(file=_FAULT_LOG[-1], all_threads=True)


class _Kept:
    """``sys.stdout`` written to a file as well: the terminal's rank keeps what it prints, as the agent keeps the
    other ranks' (``stdout.log`` in each rank's log directory). A terminal stays a terminal (``isatty``)."""

    def __init__(self, shown: Any, kept: Any):
        self._shown, self._kept = shown, kept

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError, ValueError):  # a full disk or a closed file: the terminal still has it
            self._kept.write(text)
        return self._shown.write(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._kept.flush()
        self._shown.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shown, name)


def keep_terminal_output(script: bool) -> None:
    """Rank 0 of node 0 prints to the terminal, untouched by the agent (its progress bar needs it); its prints go
    into its log directory's ``stdout.log`` too, where every other rank's already are, and a script's stderr (its
    own log lines) into ``stderr.log`` (a recipe's rank 0 logs to dlaunch.log, and draws its progress bar there)."""
    fault = fault_log(env_lib.error_file())
    for name in ("stdout", *(["stderr"] if script else [])):
        kept = fault.with_name(f"{name}.log") if fault is not None else None
        if kept is None or kept.exists():  # the agent writes this rank's output there itself
            return
        try:
            setattr(sys, name, _Kept(getattr(sys, name), open(kept, "a", buffering=1)))  # noqa: SIM115 - kept open
        except OSError:
            return


def already_completed(run_dir: Path, env: env_lib.WorkerEnv | None) -> bool:
    """A restart after every rank had completed (a rank aborted in teardown): nothing to redo.

    Otherwise this rank's marker from an earlier attempt is stale. Every rank sees
    the same set of markers here (none deletes one while all exist), so every rank
    decides alike.
    """
    world = env.world_size if env else 1
    rank = env.rank if env else 0
    if env is not None and env.restart_count and all(outputs.completion_marker(run_dir, r).exists() for r in range(world)):
        return True
    outputs.completion_marker(run_dir, rank).unlink(missing_ok=True)
    return False


def run(job_path: Path) -> int:
    """Run this process's part of the job; the exit code the agent sees (a failure's cause is in the error file)."""
    die_with_launcher()
    record_native_crashes()
    job = json.loads(job_path.read_text())
    keep_terminal_output(script=(job.get("spec") or {}).get("script") is not None)
    run_dir, task = Path(job["run_dir"]), env_lib.ps_task()
    env = env_lib.WorkerEnv.from_environ() if task is None else None
    rank = task.rank if task is not None else (env.rank if env else 0)
    console = Console(emoji=False, stderr=True)
    setup_logging(rank, console)
    if rank:  # the agent tags its lines (rank 0 keeps the terminal untagged, and torch's own tag)
        untag_torch_logs()
    if job.get("console_tag"):  # a sweep's job that joblib runs beside others: ``[job 3] ``
        tag_console_lines(job["console_tag"])
    log_to_file(job.get("log_file"), rank)
    if task is None and already_completed(run_dir, env):
        log.warning("restart %d: every rank had already completed this run; nothing to redo", env.restart_count)
        return 0
    if task is not None:
        outputs.completion_marker(run_dir, rank).unlink(missing_ok=True)
    # a ps task's groups end with its RPC agent
    leave = leave_group if task is None else (lambda in_step=True, wait_s=None: None)
    try:
        spec, plan = read_job(job)
        env_lib.announce_device(plan.device_type)
        if task is not None:
            from launcher.runtime import ps_task

            ps_task.run(spec, plan, task, run_dir, console)
        else:
            _train(spec, plan, env, run_dir, job["spec"], console)
        outputs.completion_marker(run_dir, rank).touch()
        leave()
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported once, by the launcher
        _UNFREED.append(exc)
        return _leave_on(exc, rank, leave)


def _leave_on(exc: BaseException, rank: int, leave: Callable[..., None]) -> int:
    """Record why this rank ends (the error file the launcher reads) and the exit code to end with."""
    if isinstance(exc, Preempted):  # the launcher was signalled too, or only the workers were (then this is the cause)
        log.warning("%s", exc)
        write_error_file(env_lib.error_file(), exc, rank, {"last_step": exc.step, "stopped_by": exc.signal_name})
        # a script's stop, or one inside a first step: wherever the signal found each rank (a barrier could meet a
        # peer's gradient all-reduce); a stop's ranks wait for each other as long as it takes (their agent bounds it
        # by launch.stop_grace_s), not as a finished rank does
        leave(in_step=exc.agreed, wait_s=None)
        return exc.exit_code
    ends = {"ends_run": True} if getattr(exc, "ends_run", False) else {}  # no restart after it (a stop's failed save)
    write_error_file(env_lib.error_file(), exc, rank, {**heartbeat.progress_of(exc), **ends})
    return 130 if isinstance(exc, KeyboardInterrupt) else exit_status(exc)


def _train(spec: RunSpec, plan: Plan, env: env_lib.WorkerEnv | None, run_dir: Path, as_written: dict, console: Console) -> None:
    """One rank of a collective job: check the ranks agree and can talk (this joins the process group), then train."""
    if env is not None and env.world_size > 1:
        preflight.check(env, as_written, spec.launch.preflight_timeout_s, plan.backend,
                        plan.device_type, spec.launch.collective_timeout_s)
    train(spec, env, run_dir, plan, console)


def _run_flushed(job_path: Path) -> int:
    code = run(job_path)
    if code == 0:  # as Python waits at exit: a script's writer thread, an executor's pending save; never the
        shutdown = getattr(threading, "_shutdown", None)  # interpreter's finalisation (gloo)
        with cut_short():  # a Ctrl-C here cuts the wait short, as it would under python
            if shutdown is not None:
                shutdown()
    with cut_short():
        end_children(wait=code == 0)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def end_children(wait: bool) -> None:
    """What Python's exit does for ``multiprocessing``'s children, which ``os._exit`` skips.

    Its finalizers first (a ``Manager``'s server, a ``Pool``'s workers end there). Then a loader's workers
    (daemonic) are stopped; left, they outlived their rank (and dlaunch) as orphans until their watchdog noticed,
    up to 5 s later. After a run that succeeded, a script's own processes are waited for, as under ``python``;
    after a failure they are stopped too (the agent of a forked worker signals the worker alone). Not by
    collecting a loader's iterator: one held in a reference cycle (a script's globals) was freed after its
    queues' feeder threads had ended, and its workers never heard the stop (5 s each).
    """
    import multiprocessing
    import multiprocessing.util

    try:
        finalize = getattr(multiprocessing.util, "_run_finalizers", None)  # CPython's own first exit step
        if finalize is not None:
            finalize(0)
        children = multiprocessing.active_children()
        stopped = [child for child in children if child.daemon or not wait]
        if stopped:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a loader's check of its workers' ends: these are ours
        for child in stopped:
            child.terminate()  # a loader's worker exits 0 on its parent's SIGTERM
        deadline = time.monotonic() + 5.0
        for child in stopped:
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                child.kill()
                child.join(1.0)
        for child in children:
            if child not in stopped:
                child.join()
    except Exception as exc:  # noqa: BLE001 - the run's exit code stands; its children are tidying, not its result
        log.warning("could not end this rank's own processes: %s", exc)


def main() -> None:
    os._exit(_run_flushed(Path(sys.argv[1])))


def run_job(job_path: str, environ: dict[str, str] | None = None, server_environ: dict[str, str] | None = None) -> int:
    """The worker as a function, forked from the warm server (``launcher/launch/warm.py``).

    ``environ``: the environment a fresh worker would have copied from dlaunch as it started the workers, where the
    server was started earlier (dlaunch's own, at the command's start: a sweep job's ``hydra.job.env_set`` came
    since); what torch elastic set for this rank over ``server_environ`` stays.

    It leaves with ``os._exit`` as ``main`` does, success included: returned, torch's process context would hold it
    (and its sockets) until every rank had returned, so a rank that finished early kept a peer still in a collective
    waiting for it until the collective's timeout. dlaunch's agent counts a worker that exited 0 as having returned 0
    (``agent._every_failure``).
    """
    guard = sys.modules.get("launcher.launch.forkserver_guard")  # the server's, imported there before the fork
    if guard is not None:
        guard.restore_stop_signals()
    release_forkserver()
    fresh_start_method()
    if environ is not None:
        rank_own = {k: v for k, v in os.environ.items() if (server_environ or {}).get(k) != v}
        os.environ.clear()
        os.environ.update({**environ, **rank_own})
    os._exit(_run_flushed(Path(job_path)))


def fresh_start_method() -> None:
    """multiprocessing's default start method, as a fresh interpreter has it (``fork`` on Linux before Python 3.14).

    A child of the forkserver inherits ``forkserver`` as its default: a script's ``DataLoader(num_workers>0)`` then
    died in multiprocessing's bootstrapping check, and a recipe's loader pickled what it runs in its workers. They
    run as they do under torchrun.
    """
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)


def release_forkserver() -> None:
    """Let the forkserver exit with dlaunch, so that this worker dies with it.

    multiprocessing hands each forked child the forkserver's keep-alive pipe: the
    server would live as long as its children, and the children (whose parent is
    the server, see ``die_with_launcher``) as long as the server, after dlaunch is
    gone. Closing this worker's end leaves dlaunch's as the only one.
    """
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None


if __name__ == "__main__":
    main()
