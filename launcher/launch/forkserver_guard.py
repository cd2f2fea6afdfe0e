"""The warm forkserver's first import (``warm.PRELOAD``), and nobody else's: the server dies with dlaunch.

Without it, a SIGKILLed dlaunch leaves the server to notice the end of its
keep-alive pipe and exit through a full interpreter shutdown (torch imported):
seconds on a busy machine, during which its workers, which die only with the
server, went on training (and saving checkpoints) with no launcher and no lock.
"""

from launcher.launch.parent_death import die_with_parent

die_with_parent()
