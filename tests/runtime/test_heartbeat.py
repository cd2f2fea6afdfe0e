"""Heartbeats: what a rank publishes, what an exception carries, and how a timeout names the missing rank."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from launcher.cluster.env import WorkerEnv
from launcher.launch import rendezvous
from launcher.runtime import heartbeat, outputs
from launcher.runtime.heartbeat import CollectiveTimeout, Heartbeat, Record
from tests.conftest import wait_for

GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1000ms for recv operation to complete"
NOW = 1000.0


def record(rank: int, step: int = 11, operation: str = "train step 12", since: float = NOW - 23, beat: float = NOW - 0.4,
           timed_out: bool = False, where: str = "") -> Record:
    return Record(rank, "h", 100 + rank, step, operation, since, beat, where, timed_out)


def test_a_live_rank_that_never_came_is_named_with_what_it_does():
    me = record(0, timed_out=True)
    stuck = record(1, where="train_step (recipe.py:9)")
    text = heartbeat.explain("the gradient all-reduce", me, {0: me, 1: stuck}, 2, 20, NOW)
    assert text.startswith('the gradient all-reduce in "train step 12" timed out after 20 s on rank 0:')
    assert ('rank 1 (host h, pid 101) has not reached it: it last completed step 11 and is in "train step 12" for 23 s, '
            "at train_step (recipe.py:9) (alive: heartbeat 0.4 s ago)") in text
    assert "launch.collective_timeout_s (now 20)" in text


def test_a_silent_rank_is_dead_or_stopped_and_a_missing_record_is_said():
    me = record(0, timed_out=True)
    text = heartbeat.explain("the all_reduce", me, {0: me, 1: record(1, beat=NOW - 25)}, 3, 20, NOW)
    assert ("rank 1 (host h, pid 101) has not reached it: it last completed step 11 and has sent no heartbeat "
            'for 25 s (dead or stopped; it was in "train step 12")') in text
    assert "rank 2 has not reached it: it never sent a heartbeat" in text


def test_ranks_that_timed_out_in_the_same_collective_are_not_named():
    records = {r: record(r, timed_out=True) for r in range(3)}
    text = heartbeat.explain("a collective", records[0], records, 3, 20, NOW)
    assert "every rank reached it and timed out, so they wait in different collectives" in text
    records[2] = record(2, timed_out=True, operation="loss reduce at step 11")
    text = heartbeat.explain("a collective", records[0], records, 3, 20, NOW)
    assert "rank 1" not in text and 'rank 2 (host h, pid 102) has not reached it' in text
    assert 'timed out in another collective, in "loss reduce at step 11"' in text


def test_a_collective_in_work_rank_0_does_alone_is_not_blamed_on_a_short_timeout():
    """A recipe's evaluate that all-reduces: the others wait for it in the store, never in its collective."""
    me = record(0, timed_out=True, operation="evaluation at the end", where="evaluate (mine.py:86)")
    waiting = {r: record(r, operation="waiting for rank 0's evaluation at the end") for r in (1, 2)}
    text = heartbeat.explain("the all_reduce", me, {0: me, **waiting}, 3, 20, NOW)
    assert text.startswith('the all_reduce in "evaluation at the end" (at evaluate (mine.py:86)) timed out after 20 s')
    assert ('rank 0 does "evaluation at the end" alone while the others wait for it outside any collective, so a '
            "collective in it has no partners and no timeout helps") in text
    assert "collective_timeout_s" not in text
    waiting[2] = record(2)  # one rank elsewhere: it may only be slow
    assert "launch.collective_timeout_s (now 20)" in heartbeat.explain("the all_reduce", me, {0: me, **waiting}, 3, 20, NOW)


def test_a_long_list_of_missing_ranks_is_cut():
    me = record(0, timed_out=True)
    text = heartbeat.explain("a collective", me, {0: me}, 20, 20, NOW)
    assert text.count("has not reached it") == heartbeat.MAX_LISTED
    assert f"... and {19 - heartbeat.MAX_LISTED} more ranks" in text


def test_an_exception_leaving_an_operation_carries_the_last_completed_step():
    watch = Heartbeat(None, None, 20)
    with watch.step(1):
        pass
    with pytest.raises(ValueError) as info:
        with watch.step(2):
            with watch.operation("data"):
                raise ValueError("bad batch")
    assert heartbeat.progress_of(info.value) == {"last_step": 1, "operation": "data"}
    assert watch._op[0] == "" and watch.last_completed == 1
    with pytest.raises(KeyError) as info:
        with watch:
            raise KeyError("after the loop")
    assert heartbeat.progress_of(info.value) == {"last_step": 1, "operation": ""}
    assert heartbeat.progress_of(ValueError("never in the loop")) == {}


def test_only_collective_timeouts_are_explained():
    assert heartbeat.is_collective_timeout(RuntimeError(GLOO_TIMEOUT))
    assert heartbeat.is_collective_timeout(dist.DistBackendError("operation timed out"))
    assert not heartbeat.is_collective_timeout(RuntimeError("DataLoader timed out after 5 seconds"))
    assert not heartbeat.is_collective_timeout(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert not heartbeat.is_collective_timeout(CollectiveTimeout(GLOO_TIMEOUT))


class _TimesOutInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(GLOO_TIMEOUT)


def test_the_collective_is_named_from_the_traceback():
    with pytest.raises(RuntimeError) as backward:
        _TimesOutInBackward.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert heartbeat.collective_kind(backward.value) == "the gradient all-reduce"
    with pytest.raises((RuntimeError, ValueError)) as c10d:
        dist.all_reduce(torch.ones(1))  # no process group: raised inside torch's all_reduce
    assert heartbeat.collective_kind(c10d.value) == "the all_reduce"
    assert heartbeat.collective_kind(RuntimeError("x")) == "a collective"


@pytest.fixture
def job(tmp_path):
    store = rendezvous.listening_store("127.0.0.1", 0)
    (tmp_path / outputs.STATE_DIR).mkdir()

    def env(rank: int) -> WorkerEnv:
        return WorkerEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2, group_rank=0,
                         master_addr="127.0.0.1", master_port=store.port, run_id="t")

    yield env, store, tmp_path


def _parked(entered: dict, done: threading.Event) -> None:
    entered["at"] = time.time()
    assert done.wait(20), "the records never came"


def _at(run_dir, rank: int, *keys: str) -> tuple:
    """``keys`` (last completed step and operation) from a rank's progress file; the thread may not have written it
    yet (Nones)."""
    keys = keys or ("step", "operation")
    try:
        progress = json.loads(outputs.progress_file(run_dir, rank).read_text())
    except (OSError, ValueError):
        return (None,) * len(keys)
    return tuple(progress[k] for k in keys)


def test_the_thread_publishes_records_and_keeps_the_progress_file(job):
    env, store, run_dir = job
    entered, done, seen, errors = {}, threading.Event(), [], []

    def observe(prefixed):  # from another thread, while the main thread is parked in user code
        def sampled_while_parked():
            records = heartbeat.read_records(prefixed, 2).values()
            return [r for r in records if r.operation.startswith("loss") and r.beat > entered.get("at", float("inf"))]
        try:
            seen.extend(wait_for(sampled_while_parked))
            # the file is rewritten by the thread: read it while the operation is still under way
            wait_for(lambda: _at(run_dir, 0) == (1, "loss reduce at step 1"))
        except BaseException as exc:  # noqa: BLE001 - failed here, reported by the test's own thread
            errors.append(exc)
        finally:
            done.set()

    with heartbeat.Heartbeat(env(0), run_dir, 20, interval_s=0.05).start() as watch:
        with watch.step(1):
            pass
        with watch.operation("loss reduce at step 1"):
            observer = threading.Thread(target=observe, args=(dist.PrefixStore(watch.prefix, store),))
            observer.start()
            _parked(entered, done)
            observer.join()
    assert not errors, errors
    assert seen, "no record sampled while the main thread was parked"
    assert (seen[0].rank, seen[0].step, seen[0].timed_out) == (0, 1, False)
    # sampled after _parked began: the innermost frame of user code, not threading.Event.wait in the stdlib
    assert seen[0].where.startswith("_parked (test_heartbeat.py:"), seen[0].where
    assert outputs.last_completed_step(run_dir, 0) == 1




def test_the_progress_file_gets_where_the_rank_is_once_its_own_code_is_seen(job):
    """A stop's save: the first beat in it may come while only dlaunch's code runs (no user frame), and the rank is
    then held in the recipe's own hook; a rank killed there must be named there. The rank's thread here idles in the
    standard library's pool first, then runs a function of this file."""
    from concurrent.futures import ThreadPoolExecutor

    env, _, run_dir = job
    entered, done = {}, threading.Event()
    with ThreadPoolExecutor(1) as rank_thread:  # the Heartbeat watches the thread it was made in
        watch = rank_thread.submit(Heartbeat, env(0), run_dir, 20, interval_s=0.05).result()
        with watch.start(), watch.operation("checkpoint save on a stop signal after step 6"):
            wait_for(lambda: _at(run_dir, 0, "operation", "where") == ("checkpoint save on a stop signal after step 6", ""))
            held = rank_thread.submit(_parked, entered, done)
            try:
                wait_for(lambda: (_at(run_dir, 0, "where")[0] or "").startswith("_parked (test_heartbeat.py:"))
            finally:
                done.set()
                held.result()


def test_a_timeout_names_the_rank_still_in_its_step(job):
    env, _, run_dir = job
    stuck = Heartbeat(env(1), run_dir, 1, interval_s=0.05).start()
    waiting = Heartbeat(env(0), run_dir, 1, interval_s=0.05).start()
    try:
        for watch in (stuck, waiting):
            with watch.step(11):
                pass
        stuck_step = stuck.step(12)
        stuck_step.__enter__()
        # the record the store has once rank 1 is inside step 12 (the file is written after the store)
        wait_for(lambda: _at(run_dir, 1) == (11, "train step 12"))
        started = time.monotonic()
        with pytest.raises(CollectiveTimeout) as info:
            with waiting.step(12):
                raise RuntimeError(GLOO_TIMEOUT)
        assert time.monotonic() - started < 2, "a quarter of the 1 s timeout to let peers time out too, and no more"
        stuck_step.__exit__(None, None, None)
    finally:
        stuck.stop()
        waiting.stop()
    text = str(info.value)
    line = test_a_timeout_names_the_rank_still_in_its_step.__code__.co_firstlineno + 15  # the raise: user code here
    assert text.startswith('a collective in "train step 12" (at test_a_timeout_names_the_rank_still_in_its_step '
                           f'(test_heartbeat.py:{line})) timed out after 1 s on rank 0:')
    assert 'rank 1 (host ' in text and 'has not reached it: it last completed step 11 and is in "train step 12" for ' in text
    assert "(alive: heartbeat " in text
    assert heartbeat.progress_of(info.value) == {"last_step": 11, "operation": "train step 12"}
    assert isinstance(info.value.__cause__, RuntimeError) and CollectiveTimeout.explained


class _CountingStore:
    """A real in-memory torch store that counts the looks the waiting rank takes."""

    def __init__(self):
        self.store, self.looks = dist.HashStore(), 0

    def check(self, keys):
        self.looks += 1
        return self.store.check(keys)


def test_a_rank_waiting_on_a_long_evaluation_looks_once_a_second_not_ten_times():
    """Ten looks a second per waiting rank is 10,000 requests a second to the job's store on a thousand ranks."""
    store = _CountingStore()
    long_ago = time.monotonic() - 60
    assert heartbeat._done(store, "done/eval", long_ago) is False
    assert store.looks <= 3
    store.store.set("done/eval", "1")
    assert heartbeat._done(store, "done/eval", long_ago) is True


def test_a_rank_waiting_on_a_short_save_looks_within_a_tenth_of_its_wait():
    """At a fixed 0.1 s, rank 0's next step after each save of a fast job waited up to 0.1 s for the rank still
    asleep: the report's examples/s fell sixfold in the windows after saves (mirrored 1x2, a save every 10 steps)."""
    assert heartbeat.look_every(0.0) == 0.005 and heartbeat.look_every(0.2) == pytest.approx(0.02)
    assert heartbeat.look_every(2.0) == 0.1 and heartbeat.look_every(5.0) == 1.0
    assert heartbeat.look_every(0.0, world=1000) == pytest.approx(0.02)  # a thousand waiting ranks: 50,000 looks/s
    clock = _Clock()  # the schedule, not this machine's timers: a second of waiting, slept on a clock of its own
    store = _CountingStore()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(heartbeat.time, "monotonic", clock.now)
        patch.setattr(heartbeat.time, "sleep", clock.sleep)
        assert heartbeat._done(store, "done/save", clock.now()) is False
    assert clock.slept[:3] == [0.005, 0.005, 0.005] and max(clock.slept) <= 0.1
    assert 35 <= store.looks <= 45  # about 10 in the first 50 ms and 30 more by 1 s; a fixed 0.1 s gave 10


class _Clock:
    def __init__(self):
        self.t, self.slept = 1000.0, []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.t += seconds
