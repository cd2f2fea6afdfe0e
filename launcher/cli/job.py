"""One job of ``dlaunch``: Hydra's task function, from its run directory to its summary.

The job locks its directories, chooses what to resume from, shows the plan and launches. Until it goes
ahead it writes nothing into a directory that holds another run: Hydra's own record of the job
(``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``, which ``dlaunch resume`` and the sweep table
read) is written here once the job starts (``hydra.output_subdir`` is null for Hydra). A refused job
(a directory in use, a checkpoint it cannot go on from, an invalid sweep combination) leaves the
directory as it was, and a sweep's table shows it refused under its own overrides. A dry run writes
nothing, refused or not: ``cli/dry_run.py`` then removes the directory Hydra made for it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from pathlib import Path
from typing import Any

from rich.console import Console

from launcher.cli import dry_run, interrupts, output, resume, resume_lines, run_record, scheduled, sweep, sweep_jobs, sweep_stop
from launcher.cluster import admission
from launcher.cluster.env import scheduler_tasks
from launcher.config import compose as composer
from launcher.config import disk
from launcher.config.errors import ConfigError, Problem, render
from launcher.launch import warm
from launcher.runtime import outputs, progress, recipe_import
from launcher.runtime.stop_signals import closing

log = logging.getLogger("dlaunch")


class Status:
    """Exit codes of the jobs Hydra ran in this process (one, or one per sweep job)."""

    codes: list[int] = []
    validated: dict[tuple[str, ...], Any] = {}  # a job's own overrides -> its RunSpec, from the pre-check
    invalid: dict[tuple[str, ...], ConfigError] = {}  # a sweep job's own overrides -> why it cannot run
    stopped: str = ""  # "job 0 was stopped by SIGINT": a sweep's later jobs do not start
    here: bool = False  # this is dlaunch's own process (main() ran here), not a joblib or submitit job's


def job_key(overrides: list[str]) -> tuple[str, ...]:
    """The overrides that shape a job's config (Hydra's own settings do not), as the pre-check and the job both
    write them: Hydra records a deletion ``~recipe`` (a script's) as ``~recipe=null``."""
    return tuple(sorted(o.removesuffix("=null") if o.startswith("~") else o
                        for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))))


def cuda_devices() -> int:
    from launcher.cluster import gpus

    return gpus.count()  # without importing torch: a config error answers at once


def task(cfg: Any) -> Any:
    """Hydra's task function: one job, in Hydra's run directory; its summary, or for Optuna the objective."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    elsewhere = HydraConfig.get().mode == RunMode.MULTIRUN and not Status.here  # a joblib worker's, a submitit task's
    if elsewhere and "joblib" in str(HydraConfig.get().launcher.get("_target_", "")):  # jobs side by side, one terminal
        progress.tag_console_lines(f"[job {HydraConfig.get().job.num}] ")
    try:
        with interrupts.between_jobs() if elsewhere else contextlib.nullcontext():  # a stop before its launch: noted
            summary = _job(cfg)
    finally:
        recipe_import.forget()  # the next job in this process imports its recipe afresh
    direction = _optimizing_sweeper()
    if direction:
        return sweep.objective(summary, str(cfg.get("sweep", {}).get("objective", "final_loss")), direction)
    return summary


def _job(cfg: Any) -> Any:
    """One job: validate (already done by the pre-check), lock its directories, plan, run; its summary (None when
    refused). A sweep job stopped by a signal stops the sweep: the jobs after it are not started."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from launcher.checkpoint import lock

    console, cuda = output.messages(), cuda_devices()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    key = job_key(list(HydraConfig.get().overrides.task))
    signum = interrupts.take_noted()  # a stop while Hydra set this job up: the sweep ends here
    if signum is not None and not Status.stopped:
        Status.stopped = f"{signal.Signals(signum).name} came between jobs"
        Status.codes.append(128 + signum)
    if HydraConfig.get().mode == RunMode.MULTIRUN and not Status.stopped:  # dlaunch stopped while others ran the jobs
        Status.stopped = sweep_stop.stopped_before(Path(HydraConfig.get().sweep.dir)) or ""
    if key in Status.invalid or Status.stopped:  # an invalid sweep combination, or a job after a stop
        return _not_run(run_dir, cfg, key, console)
    ended = len(Status.codes)  # grows once the job has an exit code: a stop after that is not one before it started
    try:
        # Validated once already by the pre-check; a sweeper's job that it could not foresee is validated here.
        # From where dlaunch was started, as the pre-check did: with hydra.job.chdir=true Hydra is in the job's own
        # directory, and relative paths (script.path, input.files) name files beside the command
        with _where_started():
            spec = Status.validated.get(key) or composer.validate(cfg, cuda)
        spec = scheduled.placed(spec)
        warm.fits(spec, cuda)  # a sweep's jobs differ: each forks from the command's warm server only if it can
        _checkpoint_dir_writable(spec, run_dir)
        with lock.held(spec, run_dir):  # released on every way out of the job; the kernel releases it after SIGKILL
            kept = run_dir / outputs.STATE_DIR / outputs.TOKEN  # a dry run shows the kept token and writes none
            spec = admission.with_token(spec, scheduled=bool(scheduler_tasks()), kept=kept,
                                        write=not dry_run.is_dry_run(cfg))
            summary = _locked_job(spec, cfg, run_dir, cuda, console)
    except (lock.Busy, lock.Unusable) as exc:
        busy = ConfigError([Problem(key=exc.key, value=str(exc.directory), message=str(exc))])
        return _refused(run_dir, cfg, busy, console, write=False)  # a live run's directory: not a byte of it
    except ConfigError as exc:  # a dry run writes nothing; a completed run kept as it was keeps its row of the sweep
        kept = isinstance(exc, resume.CompletedRunKept)
        if kept and not dry_run.is_dry_run(cfg):
            outputs.touch_record(run_dir)  # a job of this command all the same: the resumed sweep's table lists it
        return _refused(run_dir, cfg, exc, console, write=not dry_run.is_dry_run(cfg), row=not kept)
    except KeyboardInterrupt as exc:  # a lone run's SIGTERM (interrupts.Stopped) or Ctrl-C before its record
        if len(Status.codes) > ended or HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # the job had ended and said how, or a sweep's second signal: dlaunch's entry says it stopped
        log.warning("stopped by %s before the run started: nothing was trained, and %s keeps no record of this "
                    "command", str(exc) or "Ctrl-C", run_dir)  # a Ctrl-C's KeyboardInterrupt says nothing
        Status.codes.append(getattr(exc, "exit_code", 130))
        return None
    if Status.codes and Status.codes[-1] >= 128 and HydraConfig.get().mode == RunMode.MULTIRUN:
        Status.stopped = f"job {run_dir.name} was stopped by {signal.Signals(Status.codes[-1] - 128).name}"
    return summary


def _where_started() -> contextlib.AbstractContextManager:
    """In the directory dlaunch was started from, where it exists (a SLURM node may not have the submit host's)."""
    from hydra.core.hydra_config import HydraConfig

    started = Path(HydraConfig.get().runtime.cwd)
    return contextlib.chdir(started) if started.is_dir() else contextlib.nullcontext()


def _not_run(run_dir: Path, cfg: Any, key: tuple[str, ...], console: Console) -> None:
    """A sweep job that does not start: an invalid combination (its reason), or one after a job a signal stopped.

    Its directory gets the job's record and summary only where it holds no earlier run's."""
    fresh = not sweep_jobs.holds_a_run(run_dir)
    if key in Status.invalid:
        error = Status.invalid[key]
        Status.codes.append(sweep_jobs.skip(run_dir, error, console, Status.stopped))
        sweep.refused(run_dir, sweep_jobs.status_of(error), sweep_jobs.reason(error.problems))
    else:
        sweep_jobs.not_started(run_dir, Status.stopped, console)
        sweep.refused(run_dir, "not started", f"{Status.stopped}, which stopped the sweep")
    if fresh:
        run_record.record_hydra(run_dir, cfg)


def _refused(run_dir: Path, cfg: Any, exc: ConfigError, console: Console, write: bool = True, row: bool = True) -> None:
    """A job that cannot go ahead here: its problems on the terminal, its exit code, and (``row``) its row in a sweep's
    table. A directory that holds another run stays as it was; a new one records the job and why it did not run."""
    render(exc, console)
    Status.codes.append(exc.exit_code)
    status, why = sweep_jobs.status_of(exc), sweep_jobs.reason(exc.problems)
    if row:
        sweep.refused(run_dir, status, why)
    if write and sweep_jobs.record_not_run(run_dir, status, f"{type(exc).__name__}: {why}"):
        run_record.record_hydra(run_dir, cfg)


def _locked_job(spec: Any, cfg: Any, run_dir: Path, cuda: int, console: Console) -> Any:
    """The job, once it holds its directories: resume choice, plan, run; the run's summary (None for a dry run).
    ConfigError: it cannot go ahead, and nothing was written."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from launcher.config.plan import Plan
    from launcher.launch import launchers

    resume_from = _checkpoints_usable(spec, run_dir)
    weights_from = _weights_usable(spec, run_dir, resume_from)
    config = run_dir / outputs.CONFIG  # the same command again: its config as it ran, on one node (others would wait)
    same = spec.cluster.nodes == 1 and config.is_file() and config.read_text() == run_record.as_run(spec)
    done = resume.already_completed(spec, run_dir, resume_from, same)
    if done is not None:
        again = "" if resume.RESUMING else "; trainer.resume=never trains it again from step 0"
        console.print(f"{run_dir}: completed already ({outputs.SUMMARY}, {spec.trainer.steps} steps): "
                      f"nothing to resume{again}")
        if not spec.launch.dry_run:  # a dry run leaves the record as it was: the sweep's record is kept whole
            outputs.touch_record(run_dir)  # a job of this command all the same: a resumed sweep's table lists it
        Status.codes.append(0)
        return done
    resume.refuse_training_again(spec, run_dir, resume_from)
    plan = Plan.resolve(spec, cuda)  # once: shown, then written into the job file for the workers
    _say_of_the_devices(spec, plan, cuda)
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    # A dry run reads the input files whole, and a ps plan runs the recipe's build(): either may refuse here.
    sweep_jobs.show_plan(spec, plan, run_dir, output.results(), spec.launch.dry_run, resume_from, multirun)
    if spec.launch.dry_run:  # the plan alone: nothing written (cli/dry_run.py removes the directory Hydra made)
        Status.codes.append(0)
        return None
    before = outputs.snapshot_record(run_dir) if _resumes_itself(spec, run_dir, resume_from) else None
    interrupted, code = False, None
    try:
        with interrupts.job_launches(), interrupts.stops_raise():  # until the launcher's (or loop's) own handling
            with interrupts.held():  # a run's record is written whole, or a stop's summary would name a run not there
                run_record.record_run(spec, cfg, run_dir, resume_from)
            interrupts.raise_noted()  # a sweep's job stopped while it got ready: now that its record is whole
            sweep_stop.raise_taken()  # the same, for joblib's jobs when it runs them here (n_jobs=1)
            code = launchers.choose(spec).launch(_resuming_from(spec, resume_from, weights_from), plan, run_dir, console)
    except KeyboardInterrupt as exc:  # before the launcher's own signal handling: a stop all the same, with its summary
        if code is None:  # else it came as the launcher returned, its stop (or end) already said: its code stands
            how = exc if isinstance(exc, interrupts.Stopped) else "Ctrl-C"
            log.warning("stopped by %s before the workers started", how)
            code, interrupted = getattr(exc, "exit_code", 130), True
    if code >= 128 and not (multirun or interrupted) and _completed_before_the_stop(spec, run_dir, code):
        code = 0  # a scheduler would start it again for nothing, to be told it has completed (a sweep stops)
    # a stopped run's summary and lines are written whole: another Ctrl-C cut them off (no summary.json, a traceback)
    with closing() if code >= 128 or interrupted else contextlib.nullcontext():
        Status.codes.append(code)
        if before is not None and (0 < code < 128 or interrupted) and _trained_nothing(run_dir, resume_from):
            outputs.restore_record(before)
            console.print(f"{run_dir}: nothing was trained past the checkpoint it resumed from, so the run's command "
                          "(.hydra/, config.yaml) is kept as it was: `dlaunch resume` replays the run that is there "
                          "(summary.json and error.txt say why this command failed)")
        return _ended(spec, run_dir, code, console, multirun)


def _say_of_the_devices(spec: Any, plan: Any, cuda: int) -> None:
    """GPUs that the run will not use, and why: a CPU build of torch, an old driver, a cluster smaller than the machine;
    a data-parallel strategy over one CPU replica."""
    from launcher.cluster import gpus

    if spec.cluster.device == "auto" and plan.device_type == "cpu":
        if gpus.cpu_torch_beside_gpus():
            log.warning("this machine has NVIDIA GPUs, but the installed torch is a CPU build, so cluster.device=auto "
                        "trains on the CPU: install a CUDA build of torch (2.11 to 2.14), or say cluster.device=cpu")
        elif why := gpus.driver_too_old():
            log.warning(f"cluster.device=auto trains on the CPU: {why}; or say cluster.device=cpu")
    if idle := gpus.unused_devices(spec.strategy.name, spec.cluster.nodes, spec.cluster.devices_per_node,
                                plan.device_type, cuda):
        log.info("%s", idle)


def _resumes_itself(spec: Any, run_dir: Path, resume_from: Path | None) -> bool:
    """Node 0 resumes this run from its own checkpoints (not a fine-tune from another run's)."""
    root = spec.trainer.checkpoint.root(run_dir).resolve()
    return resume_from is not None and not spec.cluster.node_rank and resume_from.resolve().parent == root


def _trained_nothing(run_dir: Path, resume_from: Path) -> bool:
    """A resume that failed before it completed a step past its checkpoint (its model did not fit it, its build raised)."""
    from launcher.checkpoint import layout

    summary = outputs.read_summary(run_dir) or {}
    last = summary.get("last_completed_step")
    last = last if last is not None else summary.get("last_logged_step")  # it failed before its first step
    return (last is None or last <= layout.step_of(resume_from)) and layout.latest(resume_from.parent) == resume_from


def _completed_before_the_stop(spec: Any, run_dir: Path, code: int) -> bool:
    """A stop signal (exit ``code``) that came after the run had completed: said, and then no stop."""
    from launcher.launch import report

    if not report.completed_before_the_stop(spec, run_dir):
        return False
    said = "Ctrl-C" if code == 128 + signal.SIGINT else signal.Signals(code - 128).name
    log.warning("the %s came in the run's last step or as its workers ended: the run completed, nothing was cut short "
                "(exit 0)", said)
    return True


def _ended(spec: Any, run_dir: Path, code: int, console: Console, multirun: bool = False) -> Any:
    """After the launch returned ``code``: a stop's summary and resume hint (a sweep's job: the sweep gives the one
    resume command), a failure for the scheduler (a scheduled job's parent shows a stopped one in its table, with
    the resume hint), the results."""
    from launcher.cli import resume
    from launcher.cli.plan import show_summary
    from launcher.launch import report

    if code >= 128:  # stopped by a signal, after its checkpoint
        checkpoint = resume_lines.saved(spec, run_dir)
        if not spec.cluster.node_rank:
            report.record_stop(spec, run_dir, code, checkpoint)
        console.print(resume_lines.after_signal(spec, run_dir, code, checkpoint, in_sweep=multirun))
    elif code and resume_lines.after_failure(spec, run_dir, in_sweep=multirun):
        console.print(resume_lines.after_failure(spec, run_dir, in_sweep=multirun))
    if 0 < code < 128 and scheduler_tasks():  # a stop is no failure: its summary goes back, and the sweep's table says so
        raise scheduled.JobFailed(
            f"dlaunch exited with {code} on node {spec.cluster.node_rank or 0}; its root cause is in {run_dir} "
            f"(summary.json) and in the task logs under .submitit/")
    summary = outputs.read_summary(run_dir)
    if code == 0 and not summary and spec.script is not None and not spec.cluster.node_rank and spec.cluster.task is None:
        log.warning("the script ended its processes itself (os._exit) before dlaunch wrote the run's summary: it is "
                    "written from what the script logged")
        summary = report.record_script_end(spec, run_dir)
    if code == 0 and summary:
        show_summary(summary, run_dir, output.results())
    elif code == 0 and spec.cluster.task is not None and spec.cluster.task.type != "chief":
        console.print(f"{spec.cluster.task.type}:{spec.cluster.task.index} done; the chief ({spec.cluster.master_addr}) "
                      f"wrote the results; this task's logs: {run_dir / 'logs'}")
    elif code == 0 and spec.cluster.node_rank:
        console.print(f"node {spec.cluster.node_rank} of {spec.cluster.nodes} done; rank 0 wrote the results on node 0 "
                      f"({spec.cluster.master_addr}); this node's worker logs: {run_dir / 'logs'}")
    return summary


def _optimizing_sweeper() -> str:
    """Optuna's sweeper wants a number back from each job: its study's direction ("minimize", "maximize"), else ""."""
    from hydra.core.hydra_config import HydraConfig

    return sweep.study_direction(HydraConfig.get().sweeper)


def _checkpoint_dir_writable(spec: Any, run_dir: Path) -> None:
    root = spec.trainer.checkpoint.root(run_dir)
    why = disk.unusable_dir(str(root)) if spec.trainer.checkpoint.every_steps else None
    if why:
        raise ConfigError([Problem(key="trainer.checkpoint.dir", value=str(root), message=why)])


def _checkpoints_usable(spec: Any, run_dir: Path) -> Path | None:
    """The checkpoint to resume from (None: none), verified; else ConfigError.

    Each damaged checkpoint passed over gets one warning line; when every one found is damaged, nothing starts.
    """
    root = spec.trainer.checkpoint.root(run_dir)
    if spec.trainer.resume == "never" or (spec.trainer.resume == "auto" and not root.exists()):
        return None  # nothing to read: no need for torch.distributed.checkpoint in this process
    if spec.script is not None:  # a script restores its own (launcher/checkpoint/scripts.py): nothing to choose here
        return None
    from launcher import checkpoint
    from launcher.checkpoint import fit
    from launcher.checkpoint.errors import START_AFRESH

    try:
        choice = checkpoint.select(spec, run_dir)
        if choice.path is not None:
            fit.check_shapes(choice.path, spec, run_dir)
    except checkpoint.NoIntactCheckpoint as exc:
        where = root if spec.trainer.resume == "auto" else spec.trainer.resume
        raise ConfigError([
            Problem(key="trainer.resume", value=spec.trainer.resume,
                    message=f"every checkpoint found in {where} is damaged ({len(exc.skipped)}, below); {START_AFRESH}"),
            *(Problem(key=str(path), has_value=False, message=why) for path, why in exc.skipped),
        ]) from None
    except checkpoint.CheckpointError as exc:
        raise ConfigError([Problem(key="trainer.resume", value=spec.trainer.resume, message=str(exc))]) from None
    for path, why in choice.skipped:
        log.warning("%s", checkpoint.skipped_line(path, why))
    return choice.path


def _weights_usable(spec: Any, run_dir: Path, resume_from: Path | None) -> Path | None:
    """``trainer.pretrained``'s source, matched with the model (None: none, or the run resumes); else ConfigError."""
    if spec.trainer.pretrained.path is None:
        return None  # no torch.distributed.checkpoint in this process
    from launcher.checkpoint import weights

    return weights.verified(spec, run_dir, resume_from)


def _resuming_from(spec: Any, path: Path | None, weights_from: Path | None = None) -> Any:
    """The spec the workers get: ``trainer.resume`` names the checkpoint verified here, and ``trainer.pretrained``
    the weights' source, so they choose nothing again."""
    trainer = spec.trainer
    if path is not None:  # a resume brings its own weights: the workers load no pretrained ones (nor are refused them)
        trainer = trainer.model_copy(update={"resume": str(path), "pretrained": trainer.pretrained.model_copy(update={"path": None})})
    if weights_from is not None:
        trainer = trainer.model_copy(update={"pretrained": trainer.pretrained.model_copy(update={"path": str(weights_from)})})
    return spec if trainer is spec.trainer else spec.model_copy(update={"trainer": trainer})
