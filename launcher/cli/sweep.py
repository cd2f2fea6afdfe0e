"""The end of a sweep (``dlaunch -m ...``): one table of every job, and the same data as JSON and CSV.

A Hydra callback (``hydra.callbacks.sweep_summary`` in ``conf/config.yaml``),
so it runs in the process that launched the sweep whatever launcher ran the
jobs (in turn, joblib's processes, SLURM): it reads each job's directory.

    dlaunch -m strategy=one_device,mirrored recipe.optimizer.lr=0.1,0.01
    # ... then: sweep summary (4 jobs, 1 failed) and SWEEP_DIR/sweep_summary.json, .csv
"""

from __future__ import annotations

import contextlib
import json
import math
import shlex
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from launcher.cli import resume, resume_lines
from launcher.cli.sweep_table import _CUT_SHORT, COLUMNS, params, show, write
from launcher.runtime import outputs
from launcher.runtime.progress import log

RESUMING = resume.ADDED  # what `dlaunch resume` adds to every job it replays (and the default): not the job's own
_outcome: dict[str, Any] = {"failed": 0, "stopped": 0}


class _ThisSweep:
    """When this sweep started, and its directory's earlier ``multirun.yaml`` (Hydra replaces it before any job
    can refuse)."""

    started: float = 0.0
    earlier_record: str | None = None
    before: dict[str, int] = {}  # job directories already there: their record's mtime (ns), to tell an earlier sweep's


REFUSED = "refused-{job}.json"  # SWEEP_DIR/.dlaunch/: a refused job's row, from whichever process ran the job


class SweepSummary(Callback):
    """``on_multirun_end``: the sweep's table on the terminal, ``sweep_summary.json`` and ``.csv`` beside the jobs."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from launcher.cli import sweep_stop

        sweep_dir = Path(config.hydra.sweep.dir)
        _outcome.update(failed=0, stopped=0)  # an earlier sweep's in this process (tests run several)
        _DIRECTIONS_SAID.clear()
        sweep_stop.started(sweep_dir)  # from here a stop signal stops the sweep's jobs run elsewhere
        for stale in (sweep_dir / outputs.STATE_DIR).glob(REFUSED.format(job="*")):  # an earlier command's
            stale.unlink()
        record = sweep_dir / resume.SWEEP_FILE
        _ThisSweep.started = time.time()
        _ThisSweep.earlier_record = record.read_text() if record.is_file() else None
        _ThisSweep.before = {d.name: _record_mtime(d) for d in _job_dirs(sweep_dir)}

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        _keep_earlier_record(sweep_dir)
        if _dry_run_said(config, sweep_dir):
            return
        rows = collect(sweep_dir)
        if not rows:
            return
        direction = study_direction(config.hydra.get("sweeper")) or None
        objective = str(config.get("sweep", {}).get("objective", outputs.DEFAULT_OBJECTIVE)) if direction else None
        write(sweep_dir, rows, direction, objective)
        from launcher.cli import output

        show(rows, sweep_dir, output.results(), direction, objective)
        _say_an_objective_no_job_reported(rows)
        _outcome["failed"] = sum(r["status"] not in ("completed", *_CUT_SHORT) for r in rows)
        _outcome["stopped"] = max((r.get("_exit_code") or 0 for r in rows if r["status"] == "stopped"), default=0)
        line = _how_to_go_on(rows, sweep_dir)
        if line:
            output.messages().print(line)


def study_direction(sweeper: Any) -> str:
    """An optimizing sweeper's (Optuna's) study direction, "minimize" or "maximize", from ``hydra.sweeper``; "": the
    sweeper is not one (Hydra's basic sweeper runs every job and ranks none)."""
    from omegaconf import OmegaConf

    if not sweeper or "optuna" not in str(sweeper.get("_target_", "")).lower():
        return ""
    direction = sweeper.get("direction", "minimize")  # a Direction enum, its name, or a list of them (multi-objective)
    direction = direction[0] if OmegaConf.is_list(direction) else direction
    return str(getattr(direction, "name", direction)).lower()


def _say_an_objective_no_job_reported(rows: list[dict[str, Any]]) -> None:
    """``sweep.objective`` that no completed job reported (a typo, or a recipe without it): the table's column of
    dashes and a report with no ranking said nothing of why. Said once, with what the jobs do report."""
    from launcher.cli import output
    from launcher.config.errors import did_you_mean

    done = [r for r in rows if r["status"] == "completed" and r["metric"]]
    names = {r["metric"] for r in done} - {r["metric"] for r in done if r["metric_value"] is not None}
    for name in sorted(names):
        have = ["final_loss", *(_read_json(Path(done[0]["dir"]) / "summary.json").get("metrics") or {})]
        meant = did_you_mean(name, have)
        output.messages().print(f"sweep.objective={name}: no job reported such a metric (they report {', '.join(have)}"
                                f"{f'; did you mean {meant}?' if meant else ''}), so nothing ranks the jobs", markup=False)


def _dry_run_said(config: Any, sweep_dir: Path) -> bool:
    """A dry run's sweep: how many of its jobs will not start (each said above), in one line; no
    table (it listed the refused jobs alone, their overrides taken for every job's) and no files, so that the
    directories Hydra made go again (``dry_run.LeaveNothing``). False where the sweep is not a dry run."""
    from launcher.cli import output
    from launcher.cli.dry_run import is_dry_run

    if not is_dry_run(config):
        return False
    refusals = sorted((sweep_dir / outputs.STATE_DIR).glob(REFUSED.format(job="*")))
    for path in refusals:
        path.unlink()
    with contextlib.suppress(OSError):
        (sweep_dir / outputs.STATE_DIR).rmdir()  # where it holds nothing else
    _outcome["failed"] = len(refusals)
    n = len(refusals)
    told = f"; {n} of its jobs {'is' if n == 1 else 'are'} refused (the reasons above)" if refusals else ""
    output.messages().print(f"dry run: the sweep's plans are above{told}; nothing is started")
    return True


def _how_to_go_on(rows: list[dict[str, Any]], sweep_dir: Path) -> str:
    """The sweep's one resume command, where a job was stopped, or failed after a checkpoint ("": neither)."""
    kept = ", ".join(f"job {r['job']} at step {r['_checkpoint_step']}" for r in rows
                     if r["status"] not in ("completed", *_CUT_SHORT) and r.get("_checkpoint_step") is not None)
    stopped = any(r["status"] in _CUT_SHORT for r in rows)
    if not (stopped or kept):
        return ""
    head = "the sweep was stopped" + (f", and failed jobs saved checkpoints ({kept})" if kept else "") + ";" if stopped \
        else f"failed jobs saved checkpoints ({kept}); once the cause is fixed,"
    if not (sweep_dir / resume.SWEEP_FILE).is_file():  # an optimizing sweeper (Optuna): its study lives in its process
        jobs = [sweep_dir / str(r["job"]) for r in rows if r["status"] in _CUT_SHORT or
                (r["status"] != "completed" and r.get("_checkpoint_step") is not None)]
        return (f"{head} go on with each job: {'; '.join(resume_lines.command(j) for j in jobs)} (the sweeper's "
                "study is not replayed: `dlaunch -m` again starts a new one)")
    return (f"{head} go on with: {resume_lines.command(sweep_dir)} (completed jobs are kept, a stopped or failed job resumes "
            "from its newest checkpoint where it saved one, the others start)")


def refused(run_dir: Path, status: str, reason: str) -> None:
    """A job of a sweep that did not go ahead (``status``: config error, failed, not started), its directory
    untouched where it held an earlier run: the table shows this job's overrides and why, not what is on disk.
    Kept beside the sweep, since joblib's and SLURM's jobs run in other processes."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from launcher.config import script as script_config
    from launcher.config import user_recipes

    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN or hydra.job.num is None:
        return
    typed = user_recipes.as_shown(user_recipes.as_typed([str(o) for o in hydra.overrides.task]))
    own = [o for o in typed if not o.startswith("hydra") and o != RESUMING] + _script_tail(list(script_config.ARGS))
    row = {"job": int(hydra.job.num), "overrides": " ".join(own), "status": status, **dict.fromkeys(COLUMNS[3:]),
           "error": reason, "dir": str(Path(run_dir).resolve()), "params": params(own), "_overrides": own}
    (run_dir.parent / outputs.STATE_DIR).mkdir(parents=True, exist_ok=True)
    outputs.write_json_atomic(run_dir.parent / outputs.STATE_DIR / REFUSED.format(job=hydra.job.num), row)


def _keep_earlier_record(sweep_dir: Path) -> None:
    """A sweep run again in its directory of which no job went ahead (each refused, or a dry run: none wrote its
    ``.hydra`` record since the sweep started) leaves the earlier record there, so that ``dlaunch resume
    SWEEP_DIR`` replays the sweep that ran, not the one refused."""
    went_ahead = any(_ThisSweep.before.get(d.name) != _record_mtime(d) for d in _job_dirs(sweep_dir))
    if not went_ahead and _ThisSweep.earlier_record is not None:
        (sweep_dir / resume.SWEEP_FILE).write_text(_ThisSweep.earlier_record)


def failed_jobs() -> int:
    """Jobs of the last sweep in this process that did not complete, nor were stopped (for the exit code)."""
    return _outcome["failed"]


def stopped_code() -> int:
    """128 + N for a job of the last sweep that signal N stopped (0: none), wherever the job ran (for the exit code)."""
    return _outcome["stopped"]


def _job_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's job directories: those holding Hydra's record of a job (``hydra.sweep.subdir`` names them)."""
    if not sweep_dir.is_dir():
        return []
    return [d for d in sweep_dir.iterdir() if (d / outputs.HYDRA_RECORD / "overrides.yaml").is_file()]


def _record_mtime(job: Path) -> int:
    return (job / outputs.HYDRA_RECORD / "overrides.yaml").stat().st_mtime_ns


def _job_number(job: Path) -> int:
    if job.name.isdigit():
        return int(job.name)
    from omegaconf import OmegaConf

    return int(OmegaConf.load(job / outputs.HYDRA_RECORD / "hydra.yaml").hydra.job.num)


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job of this sweep (a job directory an earlier sweep left there, untouched, is not one), in job order."""
    jobs = [d for d in _job_dirs(sweep_dir) if _ThisSweep.before.get(d.name) != _record_mtime(d)]
    for job in [sweep_dir, *jobs]:  # a job run in another process (submitit, joblib) could not: this one knows what the user typed
        resume.keep_replayable(job)
    rows = {}
    for job in jobs:
        number = _job_number(job)
        rows[number] = _row(job, number)
    for path in (sweep_dir / outputs.STATE_DIR).glob(REFUSED.format(job="*")):  # this command's refusals
        row = _read_json(path)
        if row:
            rows[int(row["job"])] = row
    return [rows[job] for job in sorted(rows)]


def _row(job: Path, number: int) -> dict[str, Any]:
    summary = _read_json(job / "summary.json")
    metric = outputs.ranking_metric(job, summary)
    status = summary.get("status") or ("config error" if not (job / "config.yaml").exists() else "failed")
    overrides = _overrides(job)
    done = status == "completed"
    last = None if done else outputs.last_loss(job)  # a job that ended early has no final loss, only a last one
    return {
        "job": number,
        "overrides": " ".join(overrides),
        "params": params(overrides),  # the same by key: a column of its own in the CSV
        "_overrides": overrides,  # as typed, one per item (a value may hold spaces); not written out
        "status": status,
        "final_loss": summary.get("final_loss") if done else None,
        "last_logged_loss": last and last[0],
        "last_logged_step": last and last[1],
        "metric": metric,
        "metric_value": outputs.metric_value(summary, metric) if metric and done else None,
        "examples_per_sec": summary.get("examples_per_sec"),
        "wall_seconds": summary.get("wall_seconds"),
        "resumed_from_step": summary.get("resumed_from_step"),
        "error": (summary.get("error") or {}).get("exception") if status != "completed" else None,
        "dir": str(job.resolve()),  # absolute, as a refused job's: the sweep was given relative, or resumed
        "_exit_code": summary.get("exit_code"),  # a stopped job's 128 + N; not written out
        "_checkpoint_step": summary.get("checkpoint_step"),  # a stopped or failed job's newest; not written out
    }


def _overrides(job: Path) -> list[str]:
    """The job's overrides as typed, then its script's own arguments (``-- --epochs 2``) as one item: the job's
    whole command, which running it again needs."""
    path = job / outputs.HYDRA_RECORD / "overrides.yaml"
    if not path.exists():
        return []
    from omegaconf import OmegaConf

    from launcher.config.user_recipes import as_shown

    typed = [o for o in as_shown(str(o) for o in OmegaConf.load(path) if not str(o).startswith("hydra")) if o != RESUMING]
    return typed + _script_tail(_read_json_list(job / outputs.HYDRA_RECORD / outputs.SCRIPT_ARGS))


def _script_tail(args: list[str]) -> list[str]:
    """A script's own arguments as one item of a job's overrides: ``-- --epochs 2`` (none: nothing)."""
    return [shlex.join(["--", *args])] if args else []


def _read_json_list(path: Path) -> list[str]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [str(a) for a in found] if isinstance(found, list) else []


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def update_row(job: Path) -> bool:
    """A sweep's job that ``dlaunch resume SWEEP_DIR/N`` ran alone: its row in the sweep's ``sweep_summary.json`` and
    ``.csv`` becomes what its directory holds now (the other rows stay), so the sweep's record does not go on saying
    it failed. Whether there was such a summary to update."""
    sweep_dir = job.parent
    summary = _read_json(sweep_dir / outputs.SWEEP_SUMMARY)
    jobs, direction, objective = summary.get("jobs"), summary.get("direction"), summary.get("objective")
    if not isinstance(jobs, list):  # not a sweep's job (an optimizing sweeper's writes no multirun.yaml)
        return False
    rows = [r for r in jobs if isinstance(r, dict) and "job" in r]
    if not job.name.isdigit():  # Hydra names a sweep's job directories by their numbers
        return False
    row = _row(job, int(job.name))
    rows = sorted([r for r in rows if r["job"] != row["job"]] + [row], key=lambda r: r["job"])
    write(sweep_dir, rows, direction if isinstance(direction, str) else None,  # the way the sweep ranked its jobs
          objective if isinstance(objective, str) else None)
    return True


def objective(summary: dict[str, Any] | None, name: str, direction: str = "minimize") -> float:
    """The number an optimizing sweeper (Optuna) gets for a job: ``final_loss`` or a metric the recipe reports.

    A failed job, or one without that number, gets the worst value for the study's ``direction``, so Optuna ranks
    its trial last and goes on: a NaN made hydra-optuna-sweeper stop the whole study with a traceback.
    """
    worst = -math.inf if direction == "maximize" else math.inf
    _say_if_the_direction_is_against_the_name(name, direction)
    if not summary or summary.get("status") != "completed":
        return worst
    metrics = summary.get("metrics") or {}
    value = outputs.metric_value(summary, name)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        if name != "final_loss":
            from launcher.config.errors import did_you_mean

            meant = did_you_mean(name, ["final_loss", *metrics])
            log.error("sweep.objective=%s: the job reported no such metric (it has %s%s); its trial counts as the worst",
                      name, ", ".join(["final_loss", *metrics]), f"; did you mean {meant}?" if meant else "")
        return worst
    return float(value)


_DIRECTIONS_SAID: set[tuple[str, str]] = set()


def _say_if_the_direction_is_against_the_name(name: str, direction: str) -> None:
    """Optuna minimizes unless told (``hydra.sweeper.direction``): a study minimizing ``eval_accuracy`` finds the worst
    job and calls it best, silently. Said once per sweep, where the metric's name tells its direction."""
    from launcher.cli.report.jobs import lower_is_better

    lower = lower_is_better(name)
    meant = {True: "minimize", False: "maximize"}.get(lower)
    if meant is None or meant == direction or (name, direction) in _DIRECTIONS_SAID:
        return
    _DIRECTIONS_SAID.add((name, direction))
    log.warning("sweep.objective=%s: %s is better by its name, but the study's direction is %s (hydra.sweeper.direction, "
                "Optuna's default: minimize), so it looks for the %s value; hydra.sweeper.direction=%s looks for the best",
                name, "lower" if lower else "higher", direction, "highest" if direction == "maximize" else "lowest", meant)
