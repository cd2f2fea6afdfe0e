"""dlaunch's elastic agent: torch's ``LocalElasticAgent`` with bounded stops, one line per restart, and no restart
that cannot help (an emulated node's peer agent is gone).

``elastic_launch`` builds its agent from ``torch.distributed.launcher.api.LocalElasticAgent``; ``graceful_agent``
puts this one there for one launch, with that launch's settings.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID, RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.utils.store import _barrier_nonblocking
from torch.distributed.launcher import api as launcher_api

from launcher.cluster.env import ROUND_VARIABLE
from launcher.launch import failures, rendezvous, report
from launcher.runtime import outputs

log = logging.getLogger("dlaunch")
# Before a restart, how long an emulated node waits to learn that a peer node's agent is gone: a worker that failed
# because its peer died (the peer's workers go with their agent) can be seen before the agent's lifeline closes.
PEER_SETTLE_S = 5.0


class Agent(LocalElasticAgent):
    """torch's agent, except that stopping the workers after a failure never waits longer than ``shutdown_timeout``
    (``launch.shutdown_grace_s``), and stopping them on a stop signal waits ``launch.stop_grace_s``: they save first.

    That holds for workers started as interpreters and as forked functions (warm start) alike.

    In torch 2.13 the process context stops the other workers after a failure with
    ``close()``'s default grace of 30 s (and ``_stop_workers`` passes no grace
    either): a worker that does not exit on SIGTERM (one blocked in a C++
    collective, whose Python handler cannot run) held every failure for 30 s,
    whatever ``launch.shutdown_grace_s`` said.
    """

    grace_s: float = 30.0  # set per launch by graceful_agent
    stop_grace_s: float = 30.0
    teardown_marker: Path | None = None
    lost_peer: Callable[[float], int | None] | None = None  # an emulated node's: the node whose agent is gone (None: none)
    _last: Any = None  # the last RunResult seen: what a restart follows
    run_dir: Path | None = None  # the ranks' completion markers and heartbeats (None: nothing said while waiting)
    wait_note_s: float = 300.0  # launch.collective_timeout_s: how often a rank others finished before is named
    _waiting: tuple[float, float] | None = None  # since when ranks finished while another runs, and the next line's time
    killed: ClassVar[list[int]] = []  # the ranks a stop killed (SIGKILL) once launch.stop_grace_s had passed
    started: ClassVar[list[int]] = []  # this node's group rank, once per start of its workers: the nodes had met

    def _monitor_workers(self, worker_group: Any) -> Any:
        try:
            self._last = super()._monitor_workers(worker_group)
        except ValueError:  # torch parsed an error file a full disk left empty or cut short (fresh workers' path)
            for error_file in getattr(self._pcontext, "error_files", {}).values():
                set_aside_unreadable(error_file)
            self._last = super()._monitor_workers(worker_group)
        failed = getattr(self._last, "failures", None) or {}
        if failed and not failures.restarts_after([failures.from_process_failure(rank, f) for rank, f in failed.items()]):
            self._remaining_restarts = 0  # workers sent a stop signal stopped (and saved, or failed to): not to restart
        elif failed:  # the report tells a rank that completed from one that left early (os._exit(0)) and broke the rest
            failed.update({w.global_rank: ProcessFailure(local_rank=w.local_rank, pid=w.id or 0, exitcode=0, error_file="")
                           for w in worker_group.workers
                           if w.global_rank not in failed and exit_code(self._pcontext, w.local_rank) == 0})
            if self._remaining_restarts and self.lost_peer is not None and self.lost_peer(PEER_SETTLE_S) is not None:
                # Its workers went with it, and nothing starts that agent again: a restart would wait in the
                # rendezvous for a node that never comes. dlaunch's parent names the lost node as the root cause.
                self._remaining_restarts = 0
            if self._remaining_restarts == 0:  # torch stops the workers for good next: the other nodes stop theirs
                rendezvous.announce_failure(worker_group.spec.rdzv_handler, worker_group.group_rank)
        elif self._last.state == WorkerState.HEALTHY and rendezvous.failed_peer(worker_group.spec.rdzv_handler) is not None:
            # another node's workers failed for good: these are stopped as on one node (teardown), before node 0's
            # store goes, and _stop_workers reports them, each with its exit, as a failure of this node
            self._remaining_restarts = 0
            self._last = RunResult(state=WorkerState.FAILED, failures={})
        elif self._last.state == WorkerState.HEALTHY:
            self._note_waiting(worker_group)
        return self._last

    def _note_waiting(self, worker_group: Any) -> None:
        """Ranks that finished while another still runs (a file it writes after the script's last collective): the
        agent waits for it, as it should for a rank that is only slow, and says so every ``wait_note_s``."""
        if self.run_dir is None or not worker_group.workers:
            return
        world = worker_group.workers[0].world_size
        finished = [r for r in range(world) if outputs.completion_marker(self.run_dir, r).exists()]
        running = {w.global_rank: w.id or 0 for w in worker_group.workers
                   if w.global_rank not in finished and exit_code(self._pcontext, w.local_rank) is None}
        now = time.monotonic()
        if not finished or not running:
            self._waiting = None
            return
        since, due = self._waiting or (now, now + self.wait_note_s)
        self._waiting = (since, due)
        if now >= due:
            self._waiting = (since, now + self.wait_note_s)
            log.warning("%s", report.waiting_on(self.run_dir, finished, running, now - since, self.wait_note_s))

    def _exit_barrier(self) -> None:
        """This node's workers succeeded; the other nodes' may still run. torch's waits 300 s, then this agent leaves,
        with node 0's store, under a rank that is only slow (one writing a file after its script's last collective):
        this one waits however long, says so every ``wait_note_s`` (where the nodes are emulated, the node of the rank
        still running names it: one line, not two), and leaves at once when another node failed."""
        group = self._worker_group
        self._in_exit_barrier = True  # torch's: the health check keeps the agent alive meanwhile
        try:
            last = _barrier_nonblocking(store=self._store, world_size=group.group_world_size,
                                        key_prefix=_TERMINAL_STATE_SYNC_ID)
            since = time.monotonic()
            due = since + self.wait_note_s
            while not self._store.check([last]):
                lost = self.lost_peer is not None and self.lost_peer() is not None
                if lost or rendezvous.failed_peer(group.spec.rdzv_handler) is not None:
                    return
                if time.monotonic() >= due:
                    due += self.wait_note_s
                    if self.lost_peer is not None:  # emulated nodes share the run dir: the running rank's node names it
                        continue
                    log.warning("node %d's ranks finished; waiting on the other nodes' for %.0f s (dlaunch waits however "
                                "long it takes; Ctrl-C or SIGTERM stops the run)", group.group_rank, time.monotonic() - since)
                time.sleep(0.2)
        except SignalException:
            raise
        except Exception:  # noqa: BLE001 - node 0's store is gone: nothing is left to wait for
            return
        finally:
            self._in_exit_barrier = False

    def _stop_workers(self, worker_group: Any, *args: Any, **kwargs: Any) -> None:
        super()._stop_workers(worker_group, *args, **kwargs)
        last = self._last
        if last is not None and last.state == WorkerState.FAILED and not last.failures:  # stopped for another node
            last.failures.update({w.global_rank: ProcessFailure(
                local_rank=w.local_rank, pid=w.id or 0, exitcode=exit_code(self._pcontext, w.local_rank) or 0,
                error_file=self._pcontext.error_files.get(w.local_rank, "")) for w in worker_group.workers})

    def _restart_workers(self, worker_group: Any) -> None:
        """torch restarts the workers silently (its agent's log is quiet): say which rank failed and why, once."""
        failed = getattr(self._last, "failures", None) or {}
        if failed:
            root = failures.first([failures.from_process_failure(rank, f) for rank, f in failed.items()])
            limit = worker_group.spec.max_restarts
            # every rank here stopped because a peer had gone: the failure is another node's, which names it
            how = "stopped when a rank of another node ended" if failures.is_consequence(root) and \
                not root.stopped_by and worker_group.group_world_size > 1 else "failed"
            log.warning("%s %s (%s%s); restart %d of %d (launch.max_restarts): the workers start again, from the "
                        "newest checkpoint where there is one", root.who, how, root.exit,
                        f": {root.exception}" if root.exception else "", limit - self._remaining_restarts, limit)
        super()._restart_workers(worker_group)

    def _setup_local_watchdog(self, envs: dict[int, dict[str, str]]) -> None:
        """torch calls this with each worker's environment just before it starts them: each gets the rendezvous
        round, the same on every node (a node started again counts its restarts from 0, the others do not), so that
        the workers' store keys (process group, preflight, heartbeats) are this round's, not a dead attempt's."""
        group = self._worker_group
        round_ = rendezvous.round_of(group.spec.rdzv_handler, group.spec.max_restarts - self._remaining_restarts)
        for env in envs.values():
            env[ROUND_VARIABLE] = str(round_)
        super()._setup_local_watchdog(envs)

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        notes = [outputs.teardown_note(self.run_dir, w.global_rank) for w in worker_group.workers] if self.run_dir else []
        for note in notes:  # an earlier attempt's: this one's workers stop for a user's signal until told otherwise
            note.unlink(missing_ok=True)
        started = super()._start_workers(worker_group)
        Agent.started.append(worker_group.group_rank)
        failures.STDERR_LOGS.update({w.global_rank: self._pcontext.stderrs.get(w.local_rank, "") for w in worker_group.workers})
        failures.FAULT_LOGS.update({w.global_rank: str(failures.fault_log(self._pcontext.error_files.get(w.local_rank)) or "")
                                    for w in worker_group.workers})
        pcontext, grace, stop_grace, marker = self._pcontext, self.grace_s, self.stop_grace_s, self.teardown_marker
        close = pcontext.close

        def note_teardown() -> None:  # the running workers' next SIGTERM is a teardown: no stop and save to announce
            _touch([note for w, note in zip(worker_group.workers, notes) if exit_code(pcontext, w.local_rank) is None])

        def graceful_close(death_sig: Any = None, timeout: float = grace) -> None:
            # torch's agent closes from its `except SignalException` on a stop signal, and after a failure from none;
            # a SIGTERM from dlaunch's parent process after another node failed comes with the marker
            stopping = isinstance(sys.exc_info()[1], SignalException) and not (marker is not None and marker.exists())
            if not stopping:
                note_teardown()
            close(death_sig, stop_grace if stopping else min(timeout, grace))
            if stopping:  # those still running after the grace were killed: said by name, not "shut down"
                Agent.killed[:] = [w.global_rank for w in worker_group.workers
                                    if exit_code(pcontext, w.local_rank) == -signal.SIGKILL]

        pcontext.close = graceful_close
        processes = getattr(pcontext, "_pc", None)  # workers forked as functions (warm start): torch.multiprocessing's context
        if processes is not None:
            join = processes.join

            def bounded_join(timeout: float | None = None, grace_period: float | None = None) -> bool:
                # After a failure its join waits, signals SIGTERM, waits again, then SIGKILLs: 30 s each
                # unless told. Half the grace each keeps a stuck peer's end within launch.shutdown_grace_s.
                return join(timeout, grace / 2 if grace_period is None else grace_period)

            processes.join = bounded_join
            settle = processes._join_procs_with_timeout  # after a failure: before the SIGTERM, then before the SIGKILL

            def settle_torn_down(timeout: float) -> None:
                note_teardown()
                settle(timeout)

            processes._join_procs_with_timeout = settle_torn_down
            pcontext._poll = _every_failure(pcontext, processes)
        return started


def _touch(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.touch()


def exit_code(pcontext: Any, local_rank: int) -> int | None:
    """A worker's exit code once it ended (-N: signal N): forked (torch.multiprocessing) or started as a process."""
    processes = getattr(pcontext, "_pc", None)
    if processes is not None:
        return processes.processes[local_rank].exitcode
    handler = getattr(pcontext, "subprocess_handlers", {}).get(local_rank)
    return None if handler is None else handler.proc.returncode


def _every_failure(pcontext: Any, processes: Any) -> Callable[[], Any]:
    """The context's ``_poll``, reporting every worker that failed rather than the first one seen, and counting one
    that exited 0 as having returned 0.

    torch.multiprocessing's context raises for the first process it sees exit; the
    rank that failed first (the root cause) may be another, and a rank killed by a
    signal writes no error file. Once the context has stopped the others, every
    non-zero exit is known.
    """
    poll = pcontext._poll

    def poll_every_failure() -> Any:
        for local_rank, proc in enumerate(processes.processes):
            # a worker that completed leaves with os._exit(0) (worker.run_job), as a fresh one does: its return value
            # never comes through torch's queue, and torch would wait for it, and for the rank, forever
            if proc.exitcode == 0 and local_rank not in pcontext._return_values:
                pcontext._return_values[local_rank] = 0
            elif proc.exitcode not in (None, 0):
                set_aside_unreadable(pcontext.error_files[local_rank])
        result = poll()
        if result is not None and result.failures:
            for local_rank, proc in enumerate(processes.processes):
                if local_rank not in result.failures and proc.exitcode not in (None, 0):
                    set_aside_unreadable(pcontext.error_files[local_rank])  # it may have exited since the first look
                    result.failures[local_rank] = ProcessFailure(
                        local_rank=local_rank, pid=proc.pid, exitcode=proc.exitcode, error_file=pcontext.error_files[local_rank])
        return result

    return poll_every_failure


def set_aside_unreadable(error_file: str) -> None:
    """An error file that is not JSON (a full disk left it empty or cut short) renamed ``*.unreadable``: torch's
    ``ProcessFailure`` raises on it, which took the launcher down with a traceback instead of the failure's report.
    The rank is then reported as one that wrote no error file (its exit code, its stderr's last lines)."""
    try:
        with open(error_file) as fp:
            json.load(fp)
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        try:
            os.replace(error_file, error_file + ".unreadable")
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(error_file)


@contextlib.contextmanager
def graceful_agent(config: Any) -> Iterator[None]:
    """``elastic_launch`` builds its agent from this module attribute; the swap lasts one launch, with the settings
    ``elastic.local_config`` put on ``config`` (a ``LaunchConfig``)."""
    saved = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = type("_Agent", (Agent,), {
        "grace_s": config.dlaunch_grace_s, "stop_grace_s": config.dlaunch_stop_grace_s,
        "teardown_marker": config.dlaunch_teardown_marker,
        "lost_peer": staticmethod(config.dlaunch_lost_peer) if config.dlaunch_lost_peer else None,
        "run_dir": config.dlaunch_run_dir, "wait_note_s": config.dlaunch_wait_note_s})
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = saved
