"""Heartbeats: every rank says, about once a second, how far it got and what it is doing.

A daemon thread per rank publishes a ``Record`` in the job's store (the one the
launcher's rendezvous hosts): the last completed step, the operation the loop is
in and since when, and where the rank's own code is. The loop labels what it does::

    with heartbeat.start(env, run_dir, collective_timeout_s) as watch:
        for step in range(1, steps + 1):
            with watch.step(step):                    # "train step 12"; completed when it returns
                per_replica = strategy.run(replica_step, args=(next(batches),))
            with watch.operation(f"loss reduce at step {step}"):
                strategy.reduce(ReduceOp.MEAN, per_replica, axis=None)

When a collective times out inside an operation (gloo's "Timed out waiting
20000ms for recv operation"), the rank reads every rank's record and raises
``CollectiveTimeout``, naming the ranks that never reached the collective, what
they are doing and whether they are alive. Every exception that leaves an
operation carries this rank's last completed step (``progress_of``) to the
worker's error file, and the thread keeps the last record in
``RUN_DIR/.dlaunch/rank-R.progress.json`` for a rank that dies without a word
(SIGKILL, a segfault).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist

from launcher.cluster.env import WorkerEnv
from launcher.cluster.process_group import job_store
from launcher.runtime import outputs, user_frames

log = logging.getLogger("dlaunch")

INTERVAL_S = 1.0
STALE_AFTER_S = 5.0  # no record for this long: the process is dead or stopped
STORE_TIMEOUT_S = 10.0
STORE_LOSS_SETTLE_S = 5.0  # the store stopped answering: how long this rank's agent has to tear it down first
MAX_LISTED = 8  # ranks named one per line in a timeout message
_TIMEOUT_MARKERS = ("Timed out waiting", "Watchdog caught collective operation timeout")  # gloo's, nccl's


class CollectiveTimeout(RuntimeError):
    """A collective timed out; the message names the ranks that never reached it."""

    explained = True  # the message says what there is to say: no traceback


class CollectiveAlone(RuntimeError):
    """Rank 0 called a collective in work it does alone (a recipe's evaluate): no rank can join it."""

    explained = True


@dataclasses.dataclass(frozen=True)
class Record:
    """One rank's heartbeat."""

    rank: int
    host: str
    pid: int
    step: int  # the last completed step (0: none yet)
    operation: str  # what the loop is doing, "" between operations
    since: float  # when the operation began (time.time())
    beat: float  # when this record was made
    where: str = ""  # the innermost frame of the rank's own code: "train_step (recipe.py:42)"
    timed_out: bool = False  # a collective in ``operation`` timed out on this rank
    collective: str = ""  # the torch.distributed collective the rank's main thread is in ("all_reduce")

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def loads(cls, text: str | bytes) -> "Record":
        return cls(**json.loads(text))


def start(env: WorkerEnv | None, run_dir: Path | None, collective_timeout_s: float) -> "Heartbeat":
    """This rank's heartbeat, beating (a silent one unless the job has several processes)."""
    return Heartbeat(env, run_dir, collective_timeout_s).start()


class Heartbeat:
    """Publishes this rank's ``Record``; labels operations; explains collective timeouts."""

    def __init__(self, env: WorkerEnv | None, run_dir: Path | None, collective_timeout_s: float, interval_s: float = INTERVAL_S):
        self.env, self.run_dir, self.timeout_s, self.interval_s = env, run_dir, collective_timeout_s, interval_s
        self.last_completed = 0
        self._op: tuple[str, float] = ("", time.time())
        self._timed_out_in: str | None = None  # the operation a collective timed out in
        self._main = threading.get_ident()
        self._host = socket.gethostname()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.env is not None and self.env.world_size > 1

    @property
    def prefix(self) -> str:
        return f"dlaunch/heartbeat/{self.env.run_id}/{self.env.attempt}/" if self.env else ""

    def start(self) -> "Heartbeat":
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="dlaunch-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)
            self._thread = None

    def __enter__(self) -> "Heartbeat":
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        self.stop()
        if exc is not None:
            tag(exc, self.last_completed, "")
        return False

    def step(self, n: int) -> "_Operation":
        """``train step n``; when it returns, step ``n`` is completed."""
        return _Operation(self, f"train step {n}", completes=n)

    def operation(self, label: str) -> "_Operation":
        """Label what the rank does (``"loss reduce at step 12"``) for the other ranks to see."""
        return _Operation(self, label)

    def record(self) -> Record:
        (operation, since), (where, collective) = self._op, user_frames.at(self._main)
        return Record(self.env.rank if self.env else 0, self._host, os.getpid(), self.last_completed, operation, since,
                      time.time(), where, operation == self._timed_out_in, collective)

    # ----- the thread -----
    def _beat(self) -> None:
        store = self._connect()
        saved: tuple[int, str, str] | None = None
        while True:
            record = self.record()
            store = self._publish(store, record)
            # per operation, and again as the rank's own code is seen in another function (a stop's save, held in a hook)
            if (record.step, record.operation, record.where.partition(":")[0]) != saved:
                self._save(record)
                saved = (record.step, record.operation, record.where.partition(":")[0])
            if self._stopping.wait(self.interval_s):
                return

    def _connect(self) -> dist.Store | None:
        try:
            return job_store(self.env, self.prefix, STORE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - training goes on without heartbeats
            log.warning("heartbeat: cannot reach the job's store at %s:%s (%s); a hang will be reported without "
                        "the other ranks' state", self.env.master_addr, self.env.master_port, exc)
            return None

    def _publish(self, store: dist.Store | None, record: Record) -> dist.Store | None:
        if store is None:
            return None
        try:
            store.set(f"rank{record.rank}", record.dumps())
            return store
        except Exception as exc:  # noqa: BLE001 - e.g. node 0 is gone with its store
            # node 0 gone: this rank's agent finds it too, tears this rank down and says so; a lost connection is
            # this rank's own news
            if not self._stopping.wait(STORE_LOSS_SETTLE_S) and not self._torn_down():
                log.warning("heartbeat: the job's store stopped answering (%s); heartbeats stop", exc)
            return None

    def _torn_down(self) -> bool:
        return self.run_dir is not None and self.env is not None and outputs.torn_down(self.run_dir, self.env.rank)

    def _save(self, record: Record) -> None:
        if self.run_dir is None:
            return
        try:
            outputs.write_json_atomic(outputs.progress_file(self.run_dir, record.rank), dataclasses.asdict(record))
        except OSError:
            pass  # a full or read-only disk must not stop training

    # ----- work rank 0 alone does (its evaluation, its checkpoint commit) while the others wait -----
    def chief_alone(self, label: str, chief: bool) -> None:
        """After ``label``, work that rank 0 alone did: rank 0 says it is done, the others wait for that here, outside
        any collective (an evaluation may outlast a collective's timeout; nccl's watchdog would end the waiting
        ranks). A rank 0 whose heartbeat stops (it died, or was stopped) ends the wait, and so does a rank 0 seen in a
        collective in two beats: its partners are here, waiting for it, and the collective could never end."""
        if not self.enabled:
            return
        store, key = self._main_store(), f"done/{label}"
        if chief:
            store.set(key, "1")
            return
        # A dead rank 0 ends its job through the launcher within seconds; this is the backstop, with the patience
        # of a collective (rank 0's heartbeat may have stopped on a store error while rank 0 works on).
        patience = max(3 * STALE_AFTER_S, self.timeout_s)
        with _Operation(self, f"waiting for rank 0's {label}"):
            beat, seen, stuck = None, time.monotonic(), 0
            began, world = seen, self.env.world_size if self.env else 1  # how often it looks: look_every
            while not _done(store, key, began, world):
                record = read_records(store, 1).get(0)
                if record is not None and record.beat != beat:
                    beat, seen = record.beat, time.monotonic()
                    stuck = stuck + 1 if record.operation == label and record.collective else 0
                    if stuck == 2:
                        at, what = f" (at {record.where})" if record.where else "", record.collective
                        raise CollectiveAlone(
                            f'rank 0 is in torch.distributed\'s {what}{at} during its "{label}", which it does alone while '
                            f"the other ranks wait for it outside any collective: the {what} has no partners and would "
                            f"never end. Stopped rather than left to wait: {_ALONE}")
                elif time.monotonic() - seen > patience:
                    raise RuntimeError(f"rank 0 sent no heartbeat for {patience:g} s during its {label} (it died, was "
                                       "stopped, or lost the job's store)")

    def _main_store(self) -> dist.Store:
        if self.__dict__.get("_store") is None:  # the main thread's own client: the heartbeat thread has its own
            self._store = job_store(self.env, self.prefix, STORE_TIMEOUT_S)
        return self._store

    # ----- a collective timed out -----
    def timed_out(self, exc: BaseException) -> CollectiveTimeout:
        """``exc``, a timeout in the current operation, as a ``CollectiveTimeout`` naming the ranks that never came."""
        self._timed_out_in = self._op[0]
        me = self.record()  # where the collective was called from: the exception's frames (the stack is unwound)
        me = dataclasses.replace(me, where=user_frames.in_traceback(exc.__traceback__) or me.where)
        what = collective_kind(exc)
        try:
            records = self._settle(me)
        except Exception as problem:  # noqa: BLE001 - the store is gone or unreachable
            head = f'{what} in "{me.operation}" timed out after {self.timeout_s:g} s on rank {me.rank}'
            return CollectiveTimeout(f"{head} (the other ranks' heartbeats could not be read: {problem})")
        return CollectiveTimeout(explain(what, me, records, self.env.world_size, self.timeout_s, time.time()))

    def _settle(self, me: Record) -> dict[int, Record]:
        """Every rank's record, once the ranks waiting in the same collective had time to time out too."""
        store = job_store(self.env, self.prefix, STORE_TIMEOUT_S)
        store.set(f"rank{me.rank}", me.dumps())
        deadline = time.monotonic() + min(5.0, self.timeout_s / 4)
        while True:
            records = read_records(store, self.env.world_size)
            if time.monotonic() >= deadline or not _undecided(records, me, time.time()):
                return records
            time.sleep(0.1)


class _Operation:
    """``with watch.operation(label):``: cheap enough to wrap every step."""

    __slots__ = ("watch", "label", "completes", "outer")

    def __init__(self, watch: Heartbeat, label: str, completes: int | None = None):
        self.watch, self.label, self.completes = watch, label, completes

    def __enter__(self) -> None:
        self.outer = self.watch._op
        self.watch._op = (self.label, time.time())

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        try:
            if exc is None:
                if self.completes is not None:
                    self.watch.last_completed = self.completes
                return False
            tag(exc, self.watch.last_completed, self.label)
            if self.watch.enabled and is_collective_timeout(exc):
                explained = self.watch.timed_out(exc)
                tag(explained, self.watch.last_completed, self.label)
                raise explained from exc
            return False
        finally:
            self.watch._op = self.outer


def _done(store: dist.Store, key: str, began: float, world: int = 1) -> bool:
    """Whether ``key`` is set, looking for it for up to a second, as often as ``look_every`` says for a wait that
    ``began`` then. Not ``store.wait`` with a timeout: each that ran out made torch's store client log a warning
    ("waitForInput ... likely a timeout"), a line a second on every waiting rank during a long evaluation, which
    read as a fault."""
    deadline = time.monotonic() + 1.0
    while not store.check([key]):
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(look_every(now - began, world))
    return True


def look_every(waited_s: float, world: int = 1) -> float:
    """How long a rank that has waited ``waited_s`` for rank 0 sleeps before it looks again: a tenth of its wait so
    far, up to 0.1 s, and a second once it has waited 5 s. Rank 0's word is then seen within about a tenth of the
    wait: at a fixed 0.1 s, the step after each save and evaluation of a fast job took up to 0.1 s longer on rank 0
    (its all-reduce waited for the rank still asleep), which read as slower training. The shortest sleep is 5 ms,
    and 20 us per rank of the ``world``: the job's store gets at most about 50,000 looks a second however many ranks
    wait, and a long evaluation costs it one look a second per rank."""
    return 1.0 if waited_s >= 5 else min(0.1, max(0.005, world * 2e-5, waited_s / 10))


# ----- what the launcher and the worker read -----
def progress_of(exc: BaseException) -> dict[str, Any]:  # {"last_step": 11, "operation": "train step 12"}, or {}
    return dict(getattr(exc, "_dlaunch_progress", {}))


def tag(exc: BaseException, last_step: int, operation: str) -> BaseException:
    """Records where ``exc`` left the loop, unless a caller nearer its cause did (the innermost knows best)."""
    if not hasattr(exc, "_dlaunch_progress"):  # AttributeError, TypeError: an exception type without a __dict__
        with contextlib.suppress(AttributeError, TypeError):
            exc._dlaunch_progress = {"last_step": last_step, "operation": operation}  # type: ignore[attr-defined]
    return exc


def read_records(store: dist.Store, world_size: int) -> dict[int, Record]:
    keys = [f"rank{r}" for r in range(world_size)]
    if store.check(keys):
        return {r: Record.loads(v) for r, v in enumerate(store.multi_get(keys))}
    return {r: Record.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}


def is_collective_timeout(exc: BaseException) -> bool:
    """Gloo's or NCCL's timeout of a collective (not a peer that died: that is not a hang)."""
    if isinstance(exc, CollectiveTimeout) or not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(m in text for m in _TIMEOUT_MARKERS) or (isinstance(exc, dist.DistError) and "timed out" in text.lower())


def collective_kind(exc: BaseException) -> str:
    """Which collective ``exc`` came from, as its traceback shows: ``the all_reduce``, ``the gradient all-reduce``."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if frame.filename.endswith(os.path.join("distributed", "distributed_c10d.py")) and not frame.name.startswith("_"):
            return f"the {frame.name}"
    if any(frame.filename.startswith(user_frames.AUTOGRAD_DIR) for frame in frames):
        return "the gradient all-reduce"  # DDP's, waited for at the end of backward
    return "a collective"


# ----- the message -----
def explain(what: str, me: Record, records: dict[int, Record], world_size: int, timeout_s: float, now: float) -> str:
    """Which ranks never reached the collective ``me`` timed out in, and what each of them is doing."""
    at = f" (at {me.where})" if me.where else ""
    head = f'{what} in "{me.operation}"{at} timed out after {timeout_s:g} s on rank {me.rank}'
    missing = [r for r in range(world_size) if r != me.rank and not _reached(records.get(r), me)]
    if not missing:
        return (f"{head}: every rank reached it and timed out, so they wait in different collectives "
                "(one that only some ranks call, or that ranks call in a different order)")
    lines = [f"{head}:"]
    lines += [f"  {absent(r, records.get(r), now)}" for r in missing[:MAX_LISTED]]
    if len(missing) > MAX_LISTED:
        lines.append(f"  ... and {len(missing) - MAX_LISTED} more ranks")
    waiting = [records.get(r) and records[r].operation == f"waiting for rank 0's {me.operation}" for r in missing]
    if all(waiting):
        lines.append(f'rank 0 does "{me.operation}" alone while the others wait for it outside any collective, so a '
                     f"collective in it has no partners and no timeout helps: {_ALONE}")
    else:
        lines.append(f"a rank that is only slow (a long first step, work done on one rank) needs a larger "
                     f"launch.collective_timeout_s (now {timeout_s:g})")
    return "\n".join(lines)


_ALONE = "code rank 0 runs alone (a recipe's evaluate, under this strategy) must not call collectives (docs/RECIPES.md)"


def absent(rank: int, record: Record | None, now: float) -> str:
    """One rank that has not reached the collective: how far it got, what it does, whether it lives."""
    if record is None:
        return f"rank {rank} has not reached it: it never sent a heartbeat (it did not start training, or cannot reach the store)"
    done = f"it last completed step {record.step}" if record.step else "it has completed no step"
    who = f"rank {rank} (host {record.host}, pid {record.pid}) has not reached it: {done}"
    doing = f'"{record.operation}"' if record.operation else "no operation"
    age = now - record.beat
    if age > STALE_AFTER_S:
        return f"{who} and has sent no heartbeat for {age:.0f} s (dead or stopped; it was in {doing})"
    if record.timed_out:
        return f"{who} and timed out in another collective, in {doing}"
    at = f", at {record.where}" if record.where else ""
    return f"{who} and is in {doing} for {now - record.since:.0f} s{at} (alive: heartbeat {age:.1f} s ago)"


def _reached(record: Record | None, me: Record) -> bool:
    return record is not None and record.timed_out and record.operation == me.operation


def _undecided(records: dict[int, Record], me: Record, now: float) -> bool:
    """Some rank is alive in the same operation, and may yet time out in the same collective."""
    return any(r.rank != me.rank and not r.timed_out and r.operation == me.operation and now - r.beat <= STALE_AFTER_S
               for r in records.values())
