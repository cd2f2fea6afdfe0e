"""The launcher's console log handler: rich, on stderr (stdout is for `--cfg` output)."""

from __future__ import annotations

import logging

from rich.console import Console
from rich.logging import RichHandler


def stderr_handler() -> logging.Handler:
    handler = RichHandler(console=Console(stderr=True), show_path=False, show_time=False)
    handler.setFormatter(logging.Formatter("%(message)s"))
    return handler
