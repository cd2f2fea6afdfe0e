"""The ``dlaunch`` console script: warm the workers first, then import and run the CLI.

Importing the CLI imports torch (about a second). A run whose workers are local
CPU processes can have its forkserver import them on another core meanwhile
(``launcher/launch/warm.py``); this module starts it before anything heavy.
"""

from __future__ import annotations

import os
import sys

from launcher.runtime.stop_signals import closing, cut_short


def entry() -> None:
    from launcher.cli import interrupts
    from launcher.runtime.streams import reader_may_leave

    reader_may_leave()  # before any console holds sys.stdout: `dlaunch ... | head` ends with the run's own code

    interrupts.note_early()  # a Ctrl-C while torch imports would be lost inside it: noted, acted on at a safe point
    from launcher.cli import usage

    answered = usage.early_exit(sys.argv[1:])  # --help, --version, torchrun flags: answered before torch is imported
    if answered is not None:
        sys.exit(answered)
    from launcher.launch import warm

    if warm.several_nodes(sys.argv[1:]):  # torch reads it as it loads, and checking the config loads it
        from launcher.cluster import env

        env.quiet_cpp_warnings()
    try:
        warm.start_early(sys.argv[1:])
        from launcher.cli.main import main

        code = main()
    except KeyboardInterrupt as exc:  # a Ctrl-C (or a second SIGTERM, interrupts.Stopped) before the run's own handling
        print(f"dlaunch: stopped by {str(exc) or 'Ctrl-C'}", file=sys.stderr, flush=True)  # took over: no traceback
        code = getattr(exc, "exit_code", 130)
    finally:
        with cut_short():  # one more Ctrl-C here only cuts the tidying short
            warm.shutdown()  # every worker has ended by now: the server follows, and is reaped
    interrupts.release()  # the run ended and said how: a signal while dlaunch exits is not raised in its exit steps
    leave(code or interrupts.requested())  # a stop noted where nothing acted on it (--cfg job)


def leave(code: int) -> None:
    """Exit as dlaunch's workers do: Python's own exit steps run, C++ destructors at interpreter exit do not.

    After a signal, torch elastic's ``launch_agent`` leaves the rendezvous open on purpose (a restart could
    rejoin it): its keep-alive thread still calls into the C++ TCPStore as the interpreter ends, and the
    store's destructors then abort the process now and then (``terminate called without an active
    exception``, exit -6 after every message of a clean stop had been printed).
    """
    import atexit
    import threading

    # Both steps are CPython's private exit steps (3.10-3.14 have them). A Python without them exits the
    # ordinary way, with the rare abort described above rather than an AttributeError.
    shutdown, exit_funcs = getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or exit_funcs is None:
        sys.exit(code)
    # The interpreter's own first exit step: the thread-exit hooks (concurrent.futures' and joblib's executors
    # shut down there), then a wait for every non-daemon thread. Joining those threads without the hooks
    # would wait forever on an executor's manager thread (a joblib sweep's).
    # One more Ctrl-C while dlaunch exits cuts the wait it lands in short: the run said how it ended, and its code
    # stands. The exit handlers (logging, multiprocessing's children, temporary files, as at a normal exit) let it
    # go instead: atexit would print each handler it interrupts as "Exception ignored", with a traceback.
    for step in (_stop_log_tailers, shutdown):
        with cut_short():
            step()
    with closing():
        exit_funcs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _stop_log_tailers() -> None:
    """torch elastic's log tailers that an interrupted agent shutdown left running (a second Ctrl-C, or timeout(1)
    passing one on, while the agent stops its workers): their threads end only when told to, and the
    interpreter's exit would wait for them forever. Every worker has ended by now; ``TailLog.stop`` tells them."""
    tail_log = sys.modules.get("torch.distributed.elastic.multiprocessing.tail_log")
    if tail_log is None:
        return
    import gc

    for tailer in [o for o in gc.get_objects() if issubclass(type(o), tail_log.TailLog)]:  # not isinstance: no __class__ reads
        try:
            if not tailer.stopped():
                tailer.stop()
        except Exception:  # noqa: BLE001 - nothing may keep dlaunch from exiting with its code
            pass


if __name__ == "__main__":
    entry()
