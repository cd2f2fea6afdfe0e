"""One live run per run directory and per checkpoint directory.

    with lock.held(spec, run_dir):     # lock.Busy: a live run holds one of them
        ...                            # plan, workers, results

Each directory gets ``.dlaunch.lock``, locked with ``flock``. The kernel drops an
flock when its holder exits, however it exits (SIGKILL included), so a lock is
never left held by a dead process; there is no pid to poll and no race between
checking a pid and taking its file. The file records who holds it (host, pid,
start time, command) for the message a second run gets. A clean release
empties it, so a non-empty file that is not locked was left by a holder that
died: it is taken over, with a warning naming that holder.

The file is never deleted: deleting a lock file while another process waits to
lock it would let two processes lock two different files of the same name.
On node r > 0 of a multi-node job (and on a parameter-server task other than
the chief) the file is ``.dlaunch.node<r>.lock`` (``.dlaunch.<task>.lock``): the
nodes of one job share the directory, two copies of one node's command do not.
Over NFS, flock is carried by NFS byte-range locks (Linux >= 2.6.12); a file
system without locks gets a warning and no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("dlaunch")
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


class Unusable(Exception):
    """The directory cannot be made, or the lock file in it written; ``key`` is the setting that chose it."""

    def __init__(self, directory: Path, key: str, cause: OSError):
        self.directory, self.key = directory, key
        super().__init__(f"{directory} cannot be written: {cause.strerror or cause}; give this run another {key}")


class Busy(Exception):
    """A live run holds the directory; ``key`` is the setting that chose it."""

    def __init__(self, directory: Path, key: str, holder: dict[str, Any]):
        self.directory, self.key, self.holder = directory, key, holder
        super().__init__(f"{directory} is in use by a live run: {describe(holder)}; wait for it to end, "
                         f"or give this run another {key}")


def describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "a process that has not yet written its name (it has just started)"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"


NODE_0 = ".dlaunch.lock"  # node 0's (and a single node's) lock file; another node's is .dlaunch.nodeN.lock


def file_name(spec: Any) -> str:
    c = spec.cluster
    if c.task is not None and c.task.type != "chief":
        return f".dlaunch.{c.task.type}{c.task.index}.lock"
    return f".dlaunch.node{c.node_rank}.lock" if c.node_rank else NODE_0


def node_0_was_here(run_dir: Path) -> bool:
    """Node 0's command (or a single node's) used ``run_dir``: its lock file stays there."""
    return (run_dir / NODE_0).exists()


def other_nodes_here(run_dir: Path) -> list[str]:
    """The other nodes (``node1``, a task list's ``worker0``) whose commands used ``run_dir`` too (their lock files are
    there), where node 0's did: nodes that share one run directory; [] otherwise."""
    if not node_0_was_here(run_dir):
        return []
    return sorted(p.name[len(".dlaunch."):-len(".lock")] for p in run_dir.glob(".dlaunch.*.lock"))


def directories(spec: Any, run_dir: Path) -> list[tuple[Path, str]]:
    """What a run writes to, with the setting that chose each: the run directory, and the checkpoints if it saves any."""
    found = [(run_dir, "hydra.run.dir")]
    ckpt = spec.trainer.checkpoint
    if ckpt.every_steps:
        root = ckpt.root(run_dir)
        if root.resolve() != run_dir.resolve():
            found.append((root, "trainer.checkpoint.dir"))
    return found


@contextlib.contextmanager
def held(spec: Any, run_dir: Path) -> Iterator[None]:
    """Hold the run's directories for the duration; ``Busy`` names the live holder of any of them.

    A dry run (``launch.dry_run``) holds nothing and writes nothing: it leaves no directory or lock file behind
    (``cli/dry_run.py``), and is only refused where a live run holds one of them (``check_free``).
    """
    if spec.launch.dry_run:
        for directory, key in directories(spec, run_dir):
            check_free(directory / file_name(spec), key)
        yield
        return
    with contextlib.ExitStack() as stack:
        for directory, key in directories(spec, run_dir):
            stack.enter_context(holding(directory, key, file_name(spec)))
        yield


def check_free(path: Path, key: str) -> None:
    """``Busy`` where a live run holds the lock file ``path``; nothing made or written (no file: no live holder)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        _lock(fd, path, key)
    finally:
        os.close(fd)  # drops the flock, if it took one


@contextlib.contextmanager
def holding(directory: Path, key: str, name: str = NODE_0) -> Iterator[None]:
    """Hold one directory (made if missing); ``key``: the setting that chose it, for ``Busy``'s message."""
    path = directory / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the processes this one starts
    except OSError as exc:  # what the checks before could not foresee (/proc/x as root, a read-only mount)
        raise Unusable(directory, key, exc) from None
    try:
        if not _lock(fd, path, key):
            yield
            return
        left = _read(fd)
        if left:
            log.warning("%s was locked by %s, which is gone (killed?); this run takes it over", directory, describe(left))
        _write(fd, {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                    "command": " ".join(sys.argv)[:300]})
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # released cleanly: the next run has nothing to warn about
    finally:
        os.close(fd)  # drops the flock


def _lock(fd: int, path: Path, key: str) -> bool:
    """Lock ``fd``; False where the file system has no locks (with a warning); ``Busy`` where a live run holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        raise Busy(path.parent, key, _holder(fd)) from None
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            log.warning("%s cannot be locked (%s): nothing stops a second run from using it at once", path.parent, exc.strerror)
            return False
        raise


def _holder(fd: int) -> dict[str, Any]:
    """The holder's record; a holder that has only just locked the file gets a moment to write it."""
    deadline = time.monotonic() + 1.0
    while True:
        holder = _read(fd)
        if holder or time.monotonic() > deadline:
            return holder
        time.sleep(0.05)


def _read(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _write(fd: int, record: dict[str, Any]) -> None:
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
