"""The ``dlaunch`` console script: warm the workers first, then import and run the CLI.

Importing the CLI imports torch (about a second). A run whose workers are local
CPU processes can have its forkserver import them on another core meanwhile
(``launcher/launch/warm.py``); this module starts it before anything heavy.
"""

from __future__ import annotations

import sys


def entry() -> None:
    from launcher.cli import usage

    answered = usage.early_exit(sys.argv[1:])  # --help, --version, torchrun flags: answered before torch is imported
    if answered is not None:
        sys.exit(answered)
    from launcher.launch import warm

    warm.start_early(sys.argv[1:])
    from launcher.cli.main import main

    try:
        code = main()
    finally:
        warm.shutdown()  # every worker has ended by now: the server follows, and is reaped
    sys.exit(code)


if __name__ == "__main__":
    entry()
