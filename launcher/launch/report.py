"""What the launcher tells the user when a run fails or is stopped: the root cause once, and summary.json."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from launcher.checkpoint import layout
from launcher.cluster.process_group import LEAVE_WAIT_S
from launcher.config.schema import RunSpec
from launcher.launch import failures
from launcher.runtime import outputs, progress

log = logging.getLogger("dlaunch")


def causes_of(exc: ChildFailedError, run_dir: Path, spec: RunSpec) -> tuple[list[failures.RootCause], list[failures.RootCause]]:
    """(real failures, failures of ranks that had already completed) among an agent's workers."""
    # every rank took part in the last logged step's loss reduce; a script's own records say nothing of that
    floor = last_logged_step(run_dir) if spec.script is None else None
    causes = [with_last_step(failures.from_process_failure(rank, f), run_dir, floor) for rank, f in exc.failures.items()]
    finished = [c for c in causes if outputs.completion_marker(run_dir, c.rank).exists()]
    real = [c for c in causes if c not in finished]
    return [_left_early(c, run_dir) if c.exit == failures.CLEAN_EXIT else c for c in real], \
        [c for c in finished if c.exit != failures.CLEAN_EXIT]  # a rank that completed and exited 0 is no news


def _left_early(cause: failures.RootCause, run_dir: Path) -> failures.RootCause:
    """A rank that exited 0 before the run finished (no completion marker): the cause of its peers' broken collective,
    as of its last heartbeat (it died between that and the next)."""
    try:
        beat = float(outputs.read_progress(run_dir, cause.rank)["beat"])
    except (KeyError, ValueError, TypeError):
        beat = cause.time
    return dataclasses.replace(cause, time=min(beat, cause.time), exception=(
        f"{cause.who} exited with code 0 before the run finished: its process ended without an error (os._exit(0), "
        "or sys.exit(0) where nothing catches it) while the other ranks went on, to wait for it in their next collective"))


def with_last_step(cause: failures.RootCause, run_dir: Path, floor: int | None = None) -> failures.RootCause:
    """A rank that died without saying its last completed step (SIGKILL, a segfault): its heartbeat's. ``floor``: a
    step every rank is known to have completed (the last one logged), which a heartbeat written about once a second
    can lag behind. A rank's own word stands: a step that ended in a non-finite loss is logged, not completed."""
    if cause.last_step is not None:
        return cause
    step = outputs.last_completed_step(run_dir, cause.rank)
    if floor is not None:
        step = floor if step is None else max(step, floor)
    return dataclasses.replace(cause, last_step=step)


def report_failures(real: list[failures.RootCause], finished: list[failures.RootCause], spec: RunSpec, run_dir: Path,
                    lost_node: int | None = None) -> int:
    """Show the root cause once; a rank that died after completing does not fail the run. ``lost_node``: an
    emulated node whose agent is gone, so that no restart could bring its workers back.

    Ranks that were all stopped by a signal sent to them (not to dlaunch) stopped as dlaunch stops on one,
    after their save: that is a stop (exit 128 + signal), not a failure. So is such a stop where the other ranks
    failed only on losing a stopped peer (one rank stopped at once in its first step, another had just passed it).
    """
    if not real:
        if finished:
            ranks = ", ".join(f"rank {c.rank} ({c.exit})" for c in sorted(finished, key=lambda c: c.rank))
            log.warning("%s ended abnormally during teardown after completing; the run completed", ranks)
        return 0
    if failures.is_a_stop(real):
        name = next(c.stopped_by for c in real if c.stopped_by)
        log.warning("%s reached the workers, not dlaunch (sent to them, or to a node's agent): they stopped as dlaunch "
                    "stops them, not by failing", name)
        return 128 + int(signal.Signals[name])
    root = failures.first(real)
    others = [c for c in real + finished if c.rank != root.rank]
    show_root_cause(root, others, run_dir)
    # ranks that completed: those that exited 0 are no failure of torch's, only their marker says so
    completed = sorted({c.rank for c in finished} | (completed_ranks(run_dir) - {c.rank for c in real}))
    if completed and failures.waited_on_a_peer(root):
        why = ("a rank that ends early (a script's sys.exit(0) or return on one rank)" if spec.script is not None else
               "a collective that only some ranks run (one inside the recipe's evaluate(), which rank 0 runs alone "
               "unless the strategy is fsdp or mesh: docs/RECIPES.md)")
        log.error("rank(s) %s had completed (their loop or script had ended) while %s waited for them in a collective: "
                  "%s leaves the others in a collective it never runs, which fails once the finished rank has left "
                  "(on gloo, %d s after it finished) or at launch.collective_timeout_s (%d s)",
                  ", ".join(map(str, completed)), root.who, why, int(LEAVE_WAIT_S), spec.launch.collective_timeout_s)
    if spec.launch.max_restarts and lost_node is not None:
        log.error("node %d's agent is gone, and launch.max_restarts restarts workers under a live agent only: no node "
                  "restarted its workers (summary.json: restarts 0)", lost_node)
    elif spec.launch.max_restarts and root.ends_run:
        log.error("no restart (launch.max_restarts=%d): a stop signal ended the run, and a restart would train on "
                  "against it", spec.launch.max_restarts)
    elif spec.launch.max_restarts:
        log.error("restarts exhausted: the workers were started %d times (launch.max_restarts=%d); "
                  "the panel above is the last attempt's failure", spec.launch.max_restarts + 1, spec.launch.max_restarts)
    if not spec.cluster.node_rank:  # node 0 owns summary.json (nodes may share the run directory)
        record_failure(spec, run_dir, root, others)
    return root.exit_status


def completed_ranks(run_dir: Path) -> set[int]:
    """The ranks whose loop or script completed in this attempt (their completion markers)."""
    found = (m.name.removeprefix("rank-").removesuffix(".done") for m in (run_dir / outputs.STATE_DIR).glob("rank-*.done"))
    return {int(rank) for rank in found if rank.isdigit()}


def report_child_failure(exc: ChildFailedError, spec: RunSpec, run_dir: Path) -> int:
    return report_failures(*causes_of(exc, run_dir, spec), spec, run_dir)


def logged(run_dir: Path) -> list[dict]:
    return outputs.read_records(run_dir / outputs.METRICS)


def last_logged_step(run_dir: Path) -> int | None:
    """The newest step in ``metrics.jsonl`` (None: none; a script's own file may hold records of any shape)."""
    steps = [r["step"] for r in logged(run_dir) if isinstance(r.get("step"), int) and not isinstance(r["step"], bool)]
    return steps[-1] if steps else None


def show_root_cause(root: failures.RootCause, others: Sequence[failures.RootCause], run_dir: Path,
                    console: Any = None) -> None:
    """The root-cause panel on the terminal and, at the same point, its text in ``dlaunch.log``: the lines logged
    after the panel (restarts exhausted, a lost node) follow it in the file as on the terminal."""
    failures.render(root, list(others), last_logged_step(run_dir), console)
    progress.file_only(logging.ERROR, failures.as_text(root, list(others), last_logged_step(run_dir)))


def record_failure(spec: RunSpec, run_dir: Path, root: failures.RootCause, others: Sequence[failures.RootCause] = (),
                   said: str | None = None) -> None:
    """A failed run's summary.json (the same keys as a completed one, plus the root cause) and error.txt (the
    root-cause block the terminal showed, for ``dlaunch report`` and whoever reads the directory later; ``said``:
    what the terminal showed instead, where no rank failed, the node itself did)."""
    text = said or failures.as_text(root, list(others), last_logged_step(run_dir))
    # a script's steps are its own: what its metrics.jsonl logged (last_logged_step, as the panel says), not dlaunch's
    completed = {} if spec.script is not None else {"last_completed_step": root.last_step}
    checkpoint = layout.newest(spec, run_dir)  # what a resume goes on from, once the cause is fixed
    saved = {"checkpoint": str(checkpoint) if checkpoint else None,
             "checkpoint_step": layout.step_of(checkpoint) if checkpoint else None}
    summary = {**_partial_summary(spec, run_dir, "failed"), **completed, **saved, "error": root.as_dict()}
    with _unless_unwritable(run_dir / outputs.ERROR):
        (run_dir / outputs.ERROR).write_text(text, encoding="utf-8")
    with _unless_unwritable(run_dir / outputs.SUMMARY):
        outputs.write_json_atomic(run_dir / outputs.SUMMARY, summary)


@contextlib.contextmanager
def _unless_unwritable(path: Path) -> Iterator[None]:
    """Writing a run's end into its directory, where that may fail (a full disk, a directory made read-only): the
    terminal has already shown what the file would hold, so one line says what is missing, not a traceback."""
    try:
        yield
    except OSError as exc:
        log.warning("could not write %s (%s): it may be missing, or older than this run", path, exc.strerror or exc)


def completed_before_the_stop(spec: RunSpec, run_dir: Path) -> bool:
    """A stop signal came after the run had completed: its summary.json says so, and every rank's completion marker
    is there (or none is: a run in one process); a ps job's, the chief's. Where this node does not see the others'
    markers (no shared run directory), it cannot tell: False."""
    done = [outputs.completion_marker(run_dir, r).exists() for r in spec.strategy.completing_ranks(spec.cluster)]
    return outputs.completed(run_dir) and (all(done) or not any(done))


def record_stop(spec: RunSpec, run_dir: Path, code: int, checkpoint: Path | None) -> None:
    """A run stopped by a signal (exit ``code``, 128 + the signal): its summary.json says so, and where it saved."""
    if outputs.completed(run_dir) and not _ranks_still_running(spec, run_dir):  # the signal came after the run completed
        return
    step = layout.step_of(checkpoint) if checkpoint is not None else None
    summary = {**_partial_summary(spec, run_dir, "stopped"), "stopped_by": signal.Signals(code - 128).name,
               "exit_code": code, "checkpoint": str(checkpoint) if checkpoint else None, "checkpoint_step": step}
    lost = outputs.unsaved_stop(run_dir, step)
    if lost:  # the stop's own save failed (on_error=warn): checkpoint_step is an earlier one
        summary["unsaved_checkpoint"] = lost
    with _unless_unwritable(run_dir / outputs.SUMMARY):
        outputs.write_json_atomic(run_dir / outputs.SUMMARY, summary)


def _ranks_still_running(spec: RunSpec, run_dir: Path) -> bool:
    """Some of this node's ranks completed (their marker) and another had not: rank 0 writes "completed" once its own
    part ends, and a stop while another rank still worked (a file it writes after the script's last collective) is a
    stop. A launch with no markers (in one process) has nothing to add to the summary's word."""
    world = spec.strategy.world_size(spec.cluster)
    per_node, node = max(1, world // spec.cluster.nodes), spec.cluster.node_rank
    ranks = range(world) if node is None else range(node * per_node, min(world, (node + 1) * per_node))
    ranks = [r for r in ranks if r in spec.strategy.completing_ranks(spec.cluster)]
    done = [outputs.completion_marker(run_dir, r).exists() for r in ranks]
    return any(done) and not all(done)


# What a script's run has no use for: it runs its own loop, not dlaunch's.
_LOOP_KEYS = ("global_batch_size", "steps", "first_loss", "final_loss", "examples_per_sec", "param_norm", "metrics",
              "last_logged_step")


def record_script_end(spec: RunSpec, run_dir: Path) -> dict:
    """Every process of a script ended with 0, but rank 0's summary is not there: the script ended its process itself
    (``os._exit(0)``) before dlaunch could write it. The launcher writes it from what the script logged."""
    summary = {**_partial_summary(spec, run_dir, "completed"),
               "note": "the script ended its processes itself (os._exit) before dlaunch wrote this summary"}
    with _unless_unwritable(run_dir / outputs.SUMMARY):
        outputs.write_json_atomic(run_dir / outputs.SUMMARY, summary)
    return summary


def _partial_summary(spec: RunSpec, run_dir: Path, status: str) -> dict:
    """The keys of a completed run's summary.json that a run which ended early can fill from what it logged; a
    script's run names its script (no recipe ran) and takes its steps and losses from the script's own metrics.jsonl,
    as a completed script's summary. Its last loss is ``last_logged_loss``, at ``last_logged_loss_step``, and
    ``final_loss`` None, as in the sweep's table (``last_logged_step``: its last record of any kind)."""
    summary = _loop_summary(spec, run_dir, status)
    if spec.script is not None:
        own = {"recipe": None, "script": spec.script.command(), **outputs.script_results(run_dir)}
        summary = {k: v for k, v in summary.items() if k not in _LOOP_KEYS} | own
    if "final_loss" in summary:  # what it got to, which may be of a step long before it ended: no final loss
        last = outputs.last_loss(run_dir)  # the loss and its own step (an evaluation may be logged after it)
        summary.update(final_loss=None, last_logged_loss=last and last[0], last_logged_loss_step=last and last[1])
    return summary


def _loop_summary(spec: RunSpec, run_dir: Path, status: str) -> dict:
    every = logged(run_dir)  # read once: the losses and the last logged step come from the same records
    records = [r for r in every if "loss" in r]
    return {
        "status": status,
        "strategy": spec.strategy.name,
        "recipe": spec.recipe.name,
        "cluster": spec.cluster.shape,
        "num_replicas_in_sync": spec.num_replicas,
        "world_size": spec.strategy.world_size(spec.cluster),  # as a completed run's summary (the Plan's)
        "global_batch_size": spec.input.global_batch_size,
        "steps": spec.trainer.steps,
        "first_loss": records[0]["loss"] if records else None,
        "final_loss": records[-1]["loss"] if records else None,
        "examples_per_sec": records[-1].get("examples_per_sec") if records else None,
        "wall_seconds": outputs.since_start(run_dir),
        "param_norm": None,
        "metrics": {},
        "last_logged_step": int(every[-1]["step"]) if every else None,
        "restarts": outputs.command_restarts(run_dir),
        "history": outputs.history(run_dir),
    }


def killed_on_stop(spec: RunSpec, run_dir: Path, ranks: Sequence[int]) -> str:
    """The ranks a stop killed once ``launch.stop_grace_s`` had passed (SIGKILL), each with what it was doing, and
    the checkpoint save they cut short; "" where none was killed.

    The save's ``.step-N.partial`` is never resumed from, and a run that saves removes it as it starts; with one node
    every worker has ended here, so it goes now (with several, another node's workers may still be writing it)."""
    if not ranks:
        return ""
    doing = [f"rank {r}" + (f" ({op})" if (op := _operation(run_dir, r)) else "") for r in sorted(ranks)]
    text = (f"{', '.join(doing)} did not exit within launch.stop_grace_s={spec.launch.stop_grace_s} s of the signal and "
            f"{'was' if len(doing) == 1 else 'were'} killed (SIGKILL): a rank that ignores or traps the signal, that "
            "waits in a collective for one that does, or whose save outlasts the grace, is killed so")
    root = spec.trainer.checkpoint.root(run_dir)
    cut = ", ".join(p.name for p in sorted(root.glob(".step-*.partial"))) if root.is_dir() else ""
    if cut and spec.cluster.nodes == 1:
        layout.clean_partials(root)
        text += f"; the save they cut short ({cut}) was removed: a partial save is never resumed from"
    elif cut:
        text += f"; the save they cut short ({cut}) is never resumed from, and the next run removes it"
    return text


def _operation(run_dir: Path, rank: int) -> str:
    """What a rank's heartbeat last said it was doing, and where in its own code ("train step 8, at train_step
    (recipe.py:29)", "checkpoint save ..."), or ""."""
    beat = outputs.read_progress(run_dir, rank)
    operation, where = str(beat.get("operation") or ""), str(beat.get("where") or "")
    return f"{operation}, at {where}" if operation and where else operation


def waiting_on(run_dir: Path, finished: Sequence[int], running: dict[int, int], waited_s: float, every_s: float) -> str:
    """The line for ranks that finished while others (``running``: rank to pid) still run, after ``waited_s``."""
    def one(rank: int, pid: int) -> str:
        beat = outputs.read_progress(run_dir, rank)
        seen = f'last seen in "{beat["operation"]}"' if beat.get("operation") else "no heartbeat says where (a script)"
        where = f' at {beat["where"]}' if beat.get("operation") and beat.get("where") else ""
        return f"rank {rank} (pid {pid}, host {beat.get('host') or socket.gethostname()}) for {waited_s:.0f} s, {seen}{where}"

    done = ", ".join(map(str, finished))
    return (f"rank{'s' if len(finished) > 1 else ''} {done} finished; waiting on " + "; ".join(one(r, p) for r, p in running.items())
            + f" (dlaunch waits however long it takes and says so every launch.collective_timeout_s={every_s:g} s; "
            "Ctrl-C or SIGTERM stops the run)")
