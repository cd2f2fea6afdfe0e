"""A sweep's jobs before and as they run: which combinations are invalid, and the plan once per sweep.

An invalid combination does not stop a sweep: it becomes a job that fails with
its reason (status ``config error`` in the sweep table), and the valid jobs
run. The whole sweep is refused up front only when no job is valid, or when a
job's config cannot even be composed (a typo in a key: every job has it).

    dlaunch -m strategy=one_device,mirrored cluster=1x1,1x2 trainer.steps=20
    # 3 jobs run; one_device with 1x2 is reported as a failed job with the reason
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.console import Console

from launcher.config import compose as composer
from launcher.config.errors import ConfigError, Problem, render, spelled
from launcher.runtime import outputs


@dataclasses.dataclass
class Checked:
    valid: dict[tuple[str, ...], Any] = dataclasses.field(default_factory=dict)  # job key -> RunSpec
    invalid: dict[tuple[str, ...], ConfigError] = dataclasses.field(default_factory=dict)  # its own error (exit 1 or 2)
    up_front: list[Problem] = dataclasses.field(default_factory=list)  # stop before anything runs
    error: type[ConfigError] = ConfigError  # UserCodeError (exit 1) when a recipe's own code raised
    unlisted: bool = False  # the sweep has jobs beyond ``valid`` and ``invalid`` (ranges, a sweeper's search)

    def note(self, exc: ConfigError) -> None:
        self.error = type(exc) if exc.exit_code < self.error.exit_code else self.error


def check(jobs: dict[tuple[str, ...], list[str]], cuda: int, multirun: bool, unlisted: bool = False) -> Checked:
    """Compose and validate every job (``key -> overrides``); a sweep keeps its valid jobs. ``unlisted``: the sweep
    has jobs ``jobs`` does not list (a range or interval axis, a sweeper's own search)."""
    checked = Checked(unlisted=multirun and unlisted)
    for key, job in jobs.items():
        try:
            cfg = composer.compose(job)
        except ConfigError as exc:
            exc = exc if multirun else composer.with_the_rest(exc, job, cuda)  # a sweep's jobs differ in the rest
            _add(checked.up_front, exc.problems)
            checked.note(exc)
            continue
        try:
            checked.valid[key] = composer.validate(cfg, cuda, job)
        except ConfigError as exc:
            checked.invalid[key] = exc
            checked.note(exc)
    if not multirun or not checked.valid:
        for exc in checked.invalid.values():
            _add(checked.up_front, exc.problems)
        checked.invalid.clear()
    _add(checked.up_front, _shared_checkpoints(list(checked.valid.values()), multirun and unlisted))
    checked.up_front = _one_per_key(checked.up_front)
    return checked


def _shared_checkpoints(specs: list[Any], unlisted: bool) -> list[Problem]:
    """Jobs of one sweep that save into one ``trainer.checkpoint.dir``: each would resume from (and overwrite) the
    others' checkpoints; a later job "completed" on job 0's weights with nothing trained. ``unlisted``: there are
    jobs beyond ``specs`` (ranges, a sweeper's), which share a directory that does not vary with them."""
    jobs: dict[str, int] = {}
    for spec in specs:
        c = spec.trainer.checkpoint
        if c.dir is not None and c.every_steps:
            jobs[c.dir] = jobs.get(c.dir, 0) + 1
    return [Problem(key="trainer.checkpoint.dir", value=d, message=f"{'the' if unlisted else n} jobs of this sweep would "
                    "save into and resume from this one directory; leave it unset (each job's own RUN_DIR/checkpoints) "
                    "or give each job its own (trainer.checkpoint.dir=DIR/${hydra:job.num})")
            for d, n in jobs.items() if n > 1 or unlisted]


def _add(problems: list[Problem], new: list[Problem]) -> None:
    problems.extend(p for p in new if p not in problems)


def _one_per_key(problems: list[Problem]) -> list[Problem]:
    """A key that several jobs give the same problem with other values (a typo swept over ``10,20``) is one problem
    with its values as swept, not one per job."""
    merged: dict[Problem, list[Any]] = {}
    for p in problems:
        merged.setdefault(dataclasses.replace(p, value=None), []).append(p.value)
    return [dataclasses.replace(p, value=",".join(map(spelled, values))) if p.has_value and len(values) > 1
            else dataclasses.replace(p, value=values[0]) for p, values in merged.items()]


def reason(problems: list[Problem]) -> str:
    """The problems on one line, for the sweep table."""
    return "; ".join(f"{p.key}" + (f"={spelled(p.value)}" if p.has_value else "") + f": {p.message}" + _hint(p)
                     for p in problems)


def _hint(p: Problem) -> str:
    """What was meant, as the one-screen error says it (``did you mean bf16-mixed?``), else a short allowed list."""
    if p.suggestion:
        return f" (did you mean {p.suggestion}?)"
    return f" (allowed: {', '.join(p.allowed)})" if p.allowed and len(p.allowed) <= 8 else ""


def announce_invalid(checked: Checked, console: Console, width: int = 200) -> None:
    """Before a sweep's first job: the combinations that will not start, and why (one line per reason, with how many
    jobs have it and one of them), so that a user can stop the sweep and fix them now rather than learn of each when
    its turn comes. A range axis or a sweeper's search makes jobs of its own: those are checked as they come."""
    if not checked.invalid:
        return
    keys = [set(key) for key in [*checked.valid, *checked.invalid]]
    shared = set.intersection(*keys) if keys else set()
    reasons: dict[str, list[tuple[str, ...]]] = {}  # one line per reason; an unknown key's value is no part of it
    said: dict[str, str] = {}
    for key, exc in checked.invalid.items():
        group = reason([dataclasses.replace(p, has_value=False) if p.message.startswith("unknown key") else p
                        for p in exc.problems])
        reasons.setdefault(group, []).append(key)
        said.setdefault(group, reason(exc.problems))  # the first job's, its value shown
    console.print("[bold yellow]these sweep jobs will not start[/] (each is reported as a failed job in its turn; the "
                  "other jobs run, Ctrl-C stops the sweep):", soft_wrap=True)
    for group, jobs in reasons.items():
        example, why = " ".join(o for o in jobs[0] if o not in shared) or "every job", said[group]
        why = why if len(why) <= width else why[:width - 3] + "..."
        count = f"{len(jobs)} jobs, e.g. " if len(jobs) > 1 else ""
        line = why if why.startswith(f"{example}: ") else f"{example}: {why}"  # the job is told apart by the bad value
        console.print(f"  {count}{line}", markup=False, highlight=False, soft_wrap=True)


def holds_a_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds an earlier run's record (Hydra's, or a summary), which a job that does not run keeps."""
    return (run_dir / outputs.HYDRA_RECORD).exists() or (run_dir / outputs.SUMMARY).exists()


def status_of(error: ConfigError) -> str:
    """A refused job's status: its config (exit 2), or the recipe's own code raising while it was read (exit 1)."""
    return "config error" if error.exit_code == 2 else "failed"


def record_not_run(run_dir: Path, status: str, why: str) -> bool:
    """A job that did not run says so in its ``summary.json``, where its directory holds no earlier run's record
    (that one stays as it was); whether it did."""
    if holds_a_run(run_dir):
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    outputs.write_json_atomic(run_dir / outputs.SUMMARY, {"status": status, "error": {"exception": why}})
    return True


def skip(run_dir: Path, error: ConfigError, console: Console, stopped: str = "") -> int:
    """An invalid combination's job: its problems on the terminal and, where its directory holds no earlier run,
    in its ``summary.json``; nothing runs. ``stopped``: the stop that has ended the sweep before this job's turn.

    Returns its exit code: 2 for a config error, 1 when the recipe's own code raised (a failed job).
    """
    after = f"{stopped}, which stops the sweep; its config is refused too" if stopped else "the other jobs of the sweep run"
    console.print(f"[bold red]job {run_dir.name}: not started[/] ({after})")
    render(error, console)
    record_not_run(run_dir, status_of(error), f"{type(error).__name__}: {reason(error.problems)}")
    return error.exit_code


def not_started(run_dir: Path, why: str, console: Console) -> None:
    """A job after one that a signal stopped: the sweep ends there, and where its directory holds no earlier run
    (a sweep run again keeps its results) this job's ``summary.json`` says why."""
    console.print(f"[bold yellow]job {run_dir.name}: not started[/] ({why}, which stops the sweep)")
    record_not_run(run_dir, "not started", f"{why}, which stopped the sweep")


_first_plan: dict[str, str] = {}


def show_plan(spec: Any, plan: Any, run_dir: Path, console: Console, dry_run: bool, resume_from: Path | None, multirun: bool) -> None:
    """The plan: in full for a run and for a sweep's first job; for the next jobs only the rows that differ."""
    from launcher.cli.plan import plan_rows
    from launcher.cli.plan import show_plan as show_full

    if not multirun or not _first_plan:
        rows = show_full(spec, plan, run_dir, console, dry_run, resume_from)
        if multirun:
            _first_plan.update(rows)
            first = "first job" if run_dir.name == "0" else "first job this command runs"  # a resume skips done ones
            console.print(f"(the sweep's {first}; each next job shows only what differs from it)")
        return
    rows = [(k, v) for k, v in plan_rows(spec, plan, run_dir, resume_from) if k != "run dir" and _first_plan.get(k) != v]
    console.print(f"[bold]job {run_dir.name}[/] in {run_dir}")
    for key, value in rows:
        console.print(f"  [bold]{key}[/]  {value}")
