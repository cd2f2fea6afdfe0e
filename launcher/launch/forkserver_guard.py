"""The warm forkserver's first import (``warm.PRELOAD``, and ``run_function``'s server's), and nobody else's: the server dies with
Ctrl-C while it is still importing ends it quietly, and SIGTERM or SIGHUP leave it be.

Without the first, a SIGKILLed dlaunch leaves the server to notice the end of its
keep-alive pipe and exit through a full interpreter shutdown (torch imported):
seconds on a busy machine, during which its workers, which die only with the
server, went on training (and saving checkpoints) with no launcher and no lock.

Without the second, a Ctrl-C in the first seconds of a run (the server shares dlaunch's
process group) printed a KeyboardInterrupt traceback from deep inside ``import torch`` (or, earlier still, a
``Fatal Python error`` from the interpreter's start-up: dlaunch starts the server with SIGINT blocked until here):
multiprocessing ignores SIGINT in the server only once its imports are done. dlaunch
itself reports the stop. The workers the server forks get this handler back as theirs
(multiprocessing restores what the server had before), and in them it raises
``KeyboardInterrupt``, as Python's default handler does.

Without the third, SIGTERM to dlaunch's whole process group (``timeout``, ``kill -TERM -PGID``, a scheduler that
preempts every process of a job step) killed the server at once, and with it, through their parent-death signal,
the workers it had forked, while they saved the checkpoint of the step they had agreed to stop after: the steps
since the last periodic save were lost, and a save under way was left half written. The server ends with dlaunch
(its keep-alive pipe, or its own parent-death signal); a worker takes the default action back as it starts
(``worker.run_job``).
"""

import os
import signal

from launcher.launch.parent_death import die_with_parent

_SERVER = os.getpid()


def _interrupted(signum: int, frame: object) -> None:
    if os.getpid() == _SERVER:
        os._exit(128 + signum)  # still importing: nothing to tidy, and dlaunch says why it stopped
    raise KeyboardInterrupt


def _stays(signum: int, frame: object) -> None:
    if os.getpid() == _SERVER:
        return  # its workers are saving: it ends with dlaunch
    signal.signal(signum, signal.SIG_DFL)  # a worker forked before it took the default back: as the default would
    os.kill(os.getpid(), signum)


LOADED_WITH = dict(os.environ)  # this module is the server's first import: torch loads after it, in this environment


def guard_forked_server() -> None:
    """An agent's own server, forked from the agent (``launch/agent_server.py``): guarded as this module guards
    dlaunch's, and its workers given back the stop signals dlaunch's server's workers get."""
    global _SERVER
    _SERVER = os.getpid()
    die_with_parent()
    signal.signal(signal.SIGINT, _interrupted)
    for signum, handler in BEFORE.items():
        signal.signal(signum, _stays if handler == signal.SIG_DFL else handler)


def restore_stop_signals() -> None:
    """In a forked worker (``worker.run_job``): SIGTERM and SIGHUP as the server had them before this module (the
    default, or ignored under ``nohup``)."""
    for signum, handler in BEFORE.items():
        signal.signal(signum, handler)


die_with_parent()
signal.signal(signal.SIGINT, _interrupted)
BEFORE = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
for _signum, _handler in BEFORE.items():
    if _handler == signal.SIG_DFL:  # one ignored (nohup's SIGHUP) stays ignored
        signal.signal(_signum, _stays)
# blocked since the server was started (warm.sigint_blocked): a Ctrl-C held back meanwhile ends it now
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
