"""The scratch directory of a ``run_function`` call, and its removal after a caller that was killed.

A call keeps its job and its workers' logs in ``TMPDIR/dlaunch-fn-*`` and removes the directory when it
returns. A caller killed outright (SIGKILL: a notebook kernel restarted) cannot, so each call holds an ``flock``
on its directory's ``.held`` file while it runs. The kernel drops that lock when its holder dies, however it
dies, so a directory whose lock can be taken belongs to no live call: the next call (of any process of the
same user on the same host) removes it. A directory younger than a minute is left alone (its maker may not hold
its lock yet), and so is another host's (a TMPDIR shared between hosts may lock per host).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterator

PREFIX = "dlaunch-fn-"
HELD = ".held"
SETTLE_S = 60.0


@contextlib.contextmanager
def directory() -> Iterator[Path]:
    """A new scratch directory, held (locked) until the block ends and then removed; dead calls' ones go first."""
    sweep()
    with tempfile.TemporaryDirectory(prefix=PREFIX) as tmp:
        fd = os.open(Path(tmp) / HELD, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())  # a node's lock says nothing of another's
        try:
            with contextlib.suppress(OSError):  # a file system without locks: never swept, as before
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            yield Path(tmp)
        finally:
            os.close(fd)


def sweep(root: Path | None = None, settle_s: float = SETTLE_S) -> list[Path]:
    """Remove the scratch directories under ``root`` (the temporary directory) that no live call holds."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or time.time() - info.st_mtime < settle_s:
                continue
            if (path / HELD).read_text().split()[:1] != [socket.gethostname()]:
                continue  # another node's (a TMPDIR shared between hosts): its lock may be that node's alone
            fd = os.open(path / HELD, os.O_RDONLY)
        except OSError:  # gone already, not ours, or made before calls held their directories
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live call's
            continue
        finally:
            os.close(fd)  # the sweep's own lock, if it took it
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
