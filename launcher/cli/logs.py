"""The launcher's console log handler, on stderr (stdout is for results: the plan, the result table, ``--cfg``)."""

from __future__ import annotations

import logging

from rich.console import Console

from launcher.runtime.progress import console_handler


def stderr_handler() -> logging.Handler:
    return console_handler(Console(emoji=False, stderr=True))
