"""A parameter-server job's tasks: one torch.distributed.elastic agent per task.

``dlaunch strategy=parameter_server cluster.workers=2 cluster.ps=2`` starts the
chief, two workers and two ps tasks on this machine, each as its own elastic
agent with one process; with ``cluster.task`` set (a task list across
machines) it starts that task alone. Tasks are separate agents, not one group,
so that a worker that dies does not stop the others, as TF promises: this
parent reports it and the job goes on (async mode). The chief or a ps failing
ends the attempt; with ``launch.max_restarts`` every task starts again and the
chief resumes from the newest checkpoint. Each agent is forked from the warm
server where the job has one (``launch/agents.py``), else started as::

    python -m launcher.launch.tasks JOB TYPE INDEX ATTEMPT    # one task's agent
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from launcher.cluster.env import PSTask, task_environment
from launcher.config.plan import Plan, read_job
from launcher.config.schema import RunSpec
from launcher.launch import agents, elastic, emulate, failures, rendezvous, report

log = logging.getLogger("dlaunch")
STOP_OTHERS_AFTER_S = 2.0


def all_tasks(spec: RunSpec, attempt: int = 0) -> list[PSTask]:
    return [PSTask(kind, i, rank, attempt) for rank, (kind, i) in enumerate(spec.cluster.ps_tasks())]


def launch(spec: RunSpec, run_dir: Path, plan: Plan) -> int:
    """Run this machine's tasks to the end (restarting all of them when allowed); return the exit code."""
    c = spec.cluster
    if not c.tasks:  # every task here: the chief's RPC rendezvous on a free loopback port
        spec = spec.model_copy(update={"cluster": c.model_copy(update={"master_port": c.master_port or rendezvous.free_port(c.master_addr)})})
    job = elastic.write_job(spec, run_dir, plan)
    for attempt in range(spec.launch.max_restarts + 1):
        tasks = [t for t in all_tasks(spec, attempt) if c.task is None or (t.type, t.index) == (c.task.type, c.task.index)]
        where = "on this machine" if c.task is None else "here (the other tasks run elsewhere)"
        log.info("starting %s %s, each under its own torch.distributed.elastic agent%s%s",
                 ", ".join(t.name for t in tasks), where, f" (attempt {attempt + 1})" if attempt else "", agents.how())
        code, causes = _run_attempt(spec, run_dir, job, tasks)
        if code == 0 or code >= 128 or not causes:
            return code
        if attempt < spec.launch.max_restarts:
            root = failures.first(causes)
            log.warning("%s failed (%s%s); restarting every task from the newest checkpoint (restart %d of %d)", root.who,
                        root.exit, f": {root.exception}" if root.exception else "", attempt + 1, spec.launch.max_restarts)
            _forget_failures(run_dir, tasks)
            continue
        return report.report_failures(causes, [], spec, run_dir)
    return 1


def _run_attempt(spec: RunSpec, run_dir: Path, job: Path, tasks: list[PSTask]) -> tuple[int, list[failures.RootCause]]:
    procs: dict[PSTask, agents.Agent] = {}
    marker = elastic.teardown_marker(run_dir)
    marker.unlink(missing_ok=True)  # an earlier attempt's
    with emulate._stop_on_signals(), agents.killed_on_error(procs.values()):
        try:
            for t in tasks:
                procs[t] = agents.start(task_main, [str(job), t.type, str(t.index), str(t.attempt)])
            fatal = _wait(procs, spec)
            saves = _chief_can_save(spec, fatal, {c.task for c in _causes(run_dir, tasks) if c.stopped_by})
            stopped = _stop_the_rest(procs, spec.launch.stop_grace_s + 5, marker, saves) if fatal else set()
        except emulate._Stopped as signalled:
            emulate._stop(list(procs.values()), spec.launch.stop_grace_s + 5, signalled.signum)
            log.warning("stopped by %s; every task was shut down", signal.Signals(signalled.signum).name)
            return 128 + signalled.signum, []
    # A task dlaunch stopped ended as told (a ps that waits for the chief's save is killed): not a cause
    causes = [c for c in _causes(run_dir, tasks) if c.task not in {t.name for t in stopped}]
    named = {c.task for c in causes}
    causes += [_agent_ended(t, procs[t]) for t in fatal if t.name not in named]
    if not fatal:
        for cause in causes:
            log.warning("%s had failed (%s%s); the job went on without it, as parameter-server training does",
                        cause.who, cause.exit, f": {cause.exception}" if cause.exception else "")
        return 0, []
    for t, proc in procs.items():
        if t.type == "ps" and t not in stopped and proc.returncode not in (0, None):
            ended = next((c.exit for c in causes if c.task == t.name), _exit_text(proc.returncode))
            log.error("parameter server %s unavailable: its process ended (%s); its variables are gone until the job "
                      "restarts from a checkpoint", t.name, ended)
    return 1, causes


def _wait(procs: dict[PSTask, agents.Agent], spec: RunSpec) -> list[PSTask]:
    """Wait for every task; return the ones whose failure ends the attempt (after stopping the rest).

    A worker's failure is reported and the job goes on, except in sync mode, where
    every step needs every worker's gradient.
    """
    sync = spec.strategy.mode == "sync"
    reported: set[PSTask] = set()
    while True:
        codes = {t: p.poll() for t, p in procs.items()}
        failed = [t for t, code in codes.items() if code not in (None, 0)]
        fatal = [t for t in failed if t.type != "worker" or sync]
        for t in failed:
            if t.type == "worker" and not sync and t not in reported:
                reported.add(t)
                log.warning("%s stopped (%s); the chief and the other workers go on", t.name, _exit_text(codes[t]))
        if fatal:
            return fatal
        if all(code is not None for code in codes.values()):
            return []
        time.sleep(0.05)


def _chief_can_save(spec: RunSpec, fatal: list[PSTask], stopped: set[str]) -> bool:
    """Whether a running chief, signalled, can save: checkpoints are on, and no sync round waits on a worker that
    died (the chief's push would wait for its gradients, where no signal reaches Python, until SIGKILL). A worker
    that stopped on a signal (``stopped``: the tasks whose report says so) told the ps tasks first: the chief stops
    and saves too."""
    sync_round_lost = spec.strategy.mode == "sync" and any(t.type == "worker" and t.name not in stopped for t in fatal)
    return spec.trainer.checkpoint.every_steps > 0 and not sync_round_lost


def _stop_the_rest(procs: dict[PSTask, agents.Agent], grace_s: float, marker: Path, chief_saves: bool) -> set[PSTask]:
    """The others cannot go on without the chief or a ps: a moment to end on their own, then stopped as a signal
    to dlaunch stops them (a chief that can still save, ``chief_saves``, has ``grace_s`` to; without one,
    ``marker`` tells the agents it is a teardown); returns those stopped."""
    deadline = time.monotonic() + STOP_OTHERS_AFTER_S
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    running = {t for t, p in procs.items() if p.poll() is None}
    saving = chief_saves and any(t.type == "chief" for t in running)  # else no one saves; a ps serves on until killed
    if not saving:
        emulate.mark_teardown(marker)
    emulate._stop([procs[t] for t in running], grace_s if saving else STOP_OTHERS_AFTER_S)
    return running


def _exit_text(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _agent_ended(task: PSTask, proc: agents.Agent) -> failures.RootCause:
    """A task whose agent ended without recording why (killed, out of memory): its exit is the cause."""
    return failures.RootCause(
        rank=task.rank, host=socket.gethostname(), pid=proc.pid, exit=_exit_text(proc.returncode),
        exception="its elastic agent ended without a report from its worker (the agent itself was killed?)",
        traceback="", time=time.time(), task=task.name)


def _causes(run_dir: Path, tasks: list[PSTask]) -> list[failures.RootCause]:
    out = []
    for t in tasks:
        path = emulate.failures_file(run_dir, t.rank)
        if path.exists():
            out += [failures.RootCause(**c) for c in json.loads(path.read_text())["real"]]
    return out


def _forget_failures(run_dir: Path, tasks: list[PSTask]) -> None:
    for t in tasks:
        emulate.failures_file(run_dir, t.rank).unlink(missing_ok=True)


# ---------- one task's agent (a child process) ----------
def task_main(argv: list[str]) -> int:
    from rich.console import Console

    from launcher.runtime.progress import log_to_file, setup_logging
    from launcher.runtime.worker import die_with_launcher

    die_with_launcher()
    job_path, kind, index, attempt = argv
    job = json.loads(Path(job_path).read_text())
    spec, _ = read_job(job)
    task = next(t for t in all_tasks(spec, int(attempt)) if (t.type, t.index) == (kind, int(index)))
    setup_logging(task.rank, Console(emoji=False, stderr=True), who="node")
    log_to_file(job.get("log_file"), task.rank, who="node")
    run_dir = Path(job["run_dir"])
    config = elastic.local_config(
        1, run_dir / "logs" / f"{task.type}{task.index}", max_restarts=0, join_timeout_s=spec.launch.rdzv_timeout_s,
        monitor_interval_s=spec.launch.monitor_interval_s, shutdown_grace_s=spec.launch.shutdown_grace_s,
        stop_grace_s=spec.launch.stop_grace_s, teardown_marker=elastic.teardown_marker(run_dir),
        run_id=f"dlaunch-{task.type}{task.index}-{uuid.uuid4().hex[:8]}", label=None if task.type == "chief" else task.name,
    )
    try:
        elastic.start_workers(config, elastic.WORKER_MODULE, Path(job_path), single_node=spec.cluster.loopback,
                              extra_env=task_environment(task), master_addr=spec.cluster.master_addr)
        return 0
    except ChildFailedError as exc:
        causes = [_as_task(failures.from_process_failure(0, f), task, run_dir) for f in exc.failures.values()]
        return emulate._record_failures(causes, [], spec, run_dir, task.rank)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 130


def _as_task(cause: failures.RootCause, task: PSTask, run_dir: Path) -> failures.RootCause:
    return report.with_last_step(dataclasses.replace(cause, rank=task.rank, task=task.name), run_dir)


if __name__ == "__main__":
    sys.exit(task_main(sys.argv[1:]))
