"""The warm forkserver's first import (``warm.PRELOAD``), and nobody else's: the server dies with dlaunch, and
a Ctrl-C while it is still importing ends it quietly.

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
"""

import os
import signal

from launcher.launch.parent_death import die_with_parent

_SERVER = os.getpid()


def _interrupted(signum: int, frame: object) -> None:
    if os.getpid() == _SERVER:
        os._exit(128 + signum)  # still importing: nothing to tidy, and dlaunch says why it stopped
    raise KeyboardInterrupt


die_with_parent()
signal.signal(signal.SIGINT, _interrupted)
# blocked since the server was started (warm._sigint_blocked): a Ctrl-C held back meanwhile ends it now
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
