"""A fresh worker interpreter: ``python -m launcher.runtime.worker_entry RUN_DIR/.dlaunch/job.json``.

The workers share dlaunch's process group, so a Ctrl-C reaches them too. While a
fresh interpreter imports torch and dlaunch (seconds), Python's own handler turned
it into a ``KeyboardInterrupt`` traceback from deep inside ``import torch``, once
per rank; dlaunch itself reports the stop. Here a Ctrl-C during those imports ends
the worker quietly (exit 130); once they are done, the handler it started with is back and
the run's own stop handling (``launcher/runtime/preemption.py``) takes over.
Workers forked from the warm server have the same guard there
(``launcher/launch/forkserver_guard.py``).
"""

import faulthandler
import os
import signal


def _interrupted(signum: int, frame: object) -> None:
    os._exit(128 + signum)  # still importing: nothing to tidy, and dlaunch says why it stopped


if __name__ == "__main__":
    # A native crash (a C++ abort: NCCL's watchdog, gloo; a segfault) prints every thread's Python stack, as torch
    # elastic's record() makes a forked worker do: dlaunch's root cause shows it (launch/failures.py native_crash)
    faulthandler.enable(all_threads=True)
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:  # ignored (dlaunch started in the background by a script): it stays ignored
        signal.signal(signal.SIGINT, _interrupted)
    from launcher.runtime import worker

    signal.signal(signal.SIGINT, previous)
    worker.main()
