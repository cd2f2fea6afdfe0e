"""``dlaunch``: compose and validate the config once, then launch.

    dlaunch recipe=linear strategy=mirrored cluster=1x2
    dlaunch --cfg job                      # print the composed config
    dlaunch launch.dry_run=true ...        # print the plan, start nothing
    dlaunch -m strategy=mirrored cluster=1x1,1x2 recipe.optimizer.lr=0.1,0.01   # Hydra multirun
    dlaunch recipes ls | cp NAME DEST | validate PATH    # the recipe templates
    dlaunch report RUN_OR_SWEEP_DIR        # PNG curves and report.html beside the data
    dlaunch script=train.py strategy=mirrored cluster=1x2 -- --epochs 3   # a torch script, unmodified
    dlaunch resume RUN_DIR                 # continue a stopped run in its directory

Exit codes: 0 done, 1 training failure, 2 config error (or a submission SLURM refused), 128+N stopped by signal N.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from launcher.cli import output, scheduled, sweep, sweep_jobs, usage
from launcher.cluster import admission
from launcher.cluster.env import full_errors, scheduler_tasks
from launcher.config import compose as composer
from launcher.config import script as script_config
from launcher.config.errors import ConfigError, Problem, render

log = logging.getLogger("dlaunch")
MAX_PRECHECKED_JOBS = 64
REMOTE_CUDA = 1 << 16  # validating for another machine: assume it has the devices asked for


class _Status:
    """Exit codes of the jobs Hydra ran in this process (one, or one per sweep job)."""

    codes: list[int] = []
    validated: dict[tuple[str, ...], Any] = {}  # a job's own overrides -> its RunSpec, from the pre-check
    invalid: dict[tuple[str, ...], list[Problem]] = {}  # a sweep job's own overrides -> why it cannot run
    stopped: str = ""  # "job 0 was stopped by SIGINT": a sweep's later jobs do not start


def _job_key(overrides: list[str]) -> tuple[str, ...]:
    """The overrides that shape a job's config (Hydra's own settings do not)."""
    return tuple(sorted(o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))))


def cuda_devices() -> int:
    from launcher.cluster import gpus

    return gpus.count()  # without importing torch: a config error answers at once


def _hydra_args(argv: list[str]) -> Any:
    from hydra._internal.utils import get_args_parser  # the parser hydra.main itself uses

    return get_args_parser().parse_args(argv)


def _job_overrides(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The concrete override lists a run or sweep will compose (choice sweeps expanded)."""
    if not multirun:
        return [overrides]
    parsed = composer.parse_overrides(overrides)
    axes = []
    for ov in parsed:
        if ov.is_choice_sweep():
            key = ov.get_key_element()
            axes.append([f"{key}={v}" for v in ov.sweep_string_iterator()])
        elif ov.is_sweep_override():
            continue  # ranges are the sweeper's business: each job is validated as it runs
        else:
            axes.append([ov.input_line])
    return [list(combo) for combo in itertools.islice(itertools.product(*axes), MAX_PRECHECKED_JOBS)]


_OUTPUT_DIRS = ("hydra.run.dir", "hydra.sweep.dir")


def _check_output_dirs(overrides: list[str]) -> list[Problem]:
    """An empty run directory would scatter a run's files into the current directory; a file cannot hold them."""
    problems = []
    for text in overrides:
        key, _, value = text.partition("=")
        key, value = key.lstrip("+"), value.strip().strip("'\"")
        if key not in _OUTPUT_DIRS:
            continue
        why = "must name a directory" if not value else _unusable_dir(value)
        if why:
            problems.append(Problem(key=key, value=value, message=why))
    return problems


def _unusable_dir(value: str) -> str | None:
    """Why a run directory cannot be made at ``value`` (up to its first interpolation); None if it can."""
    fixed = value.split("${")[0]
    path = Path(fixed or ".").expanduser()
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if existing.is_dir():
        return None if os.access(existing, os.W_OK | os.X_OK) else f"cannot write under {existing} (permission denied)"
    if existing == path and fixed == value:
        return f"{path} exists and is not a directory"
    return f"{existing} is not a directory, so nothing can be made under it"


def precheck(overrides: list[str], multirun: bool) -> None:
    """Compose and validate every job before anything starts; raise ConfigError."""
    composer.register_configs(overrides)
    # A SLURM job runs on nodes this machine cannot see: their devices are checked there.
    cuda = REMOTE_CUDA if scheduled.launcher_of(overrides) == "submitit_slurm" else cuda_devices()
    problems: list[Problem] = _check_output_dirs(overrides)
    checked = sweep_jobs.check({_job_key(job): job for job in _job_overrides(overrides, multirun)}, cuda, multirun)
    _Status.validated.update(checked.valid)
    _Status.invalid = checked.invalid  # a sweep's invalid combinations: each becomes a failed job with its reason
    problems.extend(p for p in checked.up_front if p not in problems)
    if problems:
        raise checked.error(problems)


def _warm_workers(overrides: list[str]) -> None:
    """Keep the forkserver that imports the workers (``launcher/launch/warm.py``) only for local CPU workers."""
    from launcher.launch import warm

    specs = list(_Status.validated.values())
    if len(specs) == 1 and not specs[0].launch.dry_run and scheduled.launcher_of(overrides) is None:
        warm.keep_if_useful(specs[0], cuda_devices())
    else:
        warm.stop()


def task(cfg: Any) -> Any:
    """Hydra's task function: one job, in Hydra's run directory; its summary, or for Optuna the objective."""
    summary = _job(cfg)
    if _optimizing_sweeper():
        return sweep.objective(summary, str(cfg.get("sweep", {}).get("objective", "final_loss")))
    return summary


def _job(cfg: Any) -> Any:
    """One job: validate (already done by the pre-check), lock its directories, plan, run; its summary (None on a config error).

    A sweep job stopped by a signal stops the sweep: the jobs after it are not started.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from launcher.cli import resume

    resume.keep_replayable(Path(HydraConfig.get().runtime.output_dir))  # first: `dlaunch resume` and the sweep table read it
    console = output.messages()
    cuda = cuda_devices()
    key = _job_key(list(HydraConfig.get().overrides.task))
    if key in _Status.invalid:
        _Status.codes.append(sweep_jobs.skip(Path(HydraConfig.get().runtime.output_dir), _Status.invalid[key], console))
        return None
    if _Status.stopped:
        sweep_jobs.not_started(Path(HydraConfig.get().runtime.output_dir), _Status.stopped, console)
        return None
    try:
        # Validated once already by the pre-check; a sweeper's job that it could not foresee is validated here.
        spec = _Status.validated.get(key) or composer.validate(cfg, cuda)
        spec = admission.with_token(scheduled.placed(spec), scheduled=bool(scheduler_tasks()))
    except ConfigError as exc:
        render(exc, console)
        _Status.codes.append(2)
        return None
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    from launcher.checkpoint import lock

    try:
        _checkpoint_dir_writable(spec, run_dir)
        with lock.held(spec, run_dir):  # released on every way out of the job; the kernel releases it after SIGKILL
            summary = _locked_job(spec, run_dir, cuda, console)
        if _Status.codes and _Status.codes[-1] >= 128 and HydraConfig.get().mode == RunMode.MULTIRUN:
            _Status.stopped = f"job {run_dir.name} was stopped by {signal.Signals(_Status.codes[-1] - 128).name}"
        return summary
    except lock.Busy as exc:
        render(ConfigError([Problem(key=exc.key, value=str(exc.directory), message=str(exc))]), console)
    except ConfigError as exc:
        render(exc, console)
    _Status.codes.append(2)
    return None


def _locked_job(spec: Any, run_dir: Path, cuda: int, console: Console) -> Any:
    """The job, once it holds its directories: resume choice, plan, run; the run's summary (None on a config error)."""
    from omegaconf import OmegaConf

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from launcher.cli import resume
    from launcher.config.plan import Plan
    from launcher.launch import launchers
    from launcher.runtime import outputs

    try:
        resume_from = _checkpoints_usable(spec, run_dir)
    except ConfigError as exc:
        render(exc, console)
        _Status.codes.append(2)
        return None
    done = resume.already_completed(spec, run_dir) if resume_from is None else None
    if done is not None:
        console.print(f"{run_dir}: completed already (summary.json), with no checkpoint to go on from: nothing to resume")
        _Status.codes.append(0)
        return done
    plan = Plan.resolve(spec, cuda)  # once: shown, then written into the job file for the workers
    try:
        multirun = HydraConfig.get().mode == RunMode.MULTIRUN
        sweep_jobs.show_plan(spec, plan, run_dir, output.results(), spec.launch.dry_run, resume_from, multirun)
    except ConfigError as exc:  # a dry run reads the input files whole; a ps plan runs the recipe's build()
        render(exc, console)
        _Status.codes.append(exc.exit_code)
        return None
    if spec.launch.dry_run:  # the plan, and the config it would run where no run has written one: a run's files stay
        if not spec.cluster.node_rank and not (run_dir / outputs.CONFIG).exists():
            (run_dir / outputs.CONFIG).write_text(OmegaConf.to_yaml(spec.model_dump(mode="json")))
        _Status.codes.append(0)
        return None
    if not spec.cluster.node_rank:  # node 0 owns the run's files; other nodes may share the directory
        outputs.start_run(run_dir, resuming=resume_from is not None)
        (run_dir / outputs.CONFIG).write_text(OmegaConf.to_yaml(spec.model_dump(mode="json")))
        outputs.record_command(run_dir)
    code = launchers.choose(spec).launch(_resuming_from(spec, resume_from), plan, run_dir, console)
    _Status.codes.append(code)
    return _ended(spec, run_dir, code, console)


def _ended(spec: Any, run_dir: Path, code: int, console: Console) -> Any:
    """After the launch returned ``code``: a stop's summary and resume hint, a failure for the scheduler, the results."""
    from launcher.cli import resume
    from launcher.cli.plan import show_summary
    from launcher.launch import report
    from launcher.runtime import outputs

    if code >= 128:  # stopped by a signal, after its checkpoint
        checkpoint = resume.saved(spec, run_dir)
        if not spec.cluster.node_rank:
            report.record_stop(spec, run_dir, code, checkpoint)
        console.print(resume.after_signal(spec, run_dir, code, checkpoint))
    if code and scheduler_tasks():
        raise scheduled.JobFailed(
            f"dlaunch exited with {code} on node {spec.cluster.node_rank or 0}; its root cause is in {run_dir} "
            f"(summary.json) and in the task logs under .submitit/")
    summary = outputs.read_summary(run_dir)
    if code == 0 and summary:
        show_summary(summary, run_dir, output.results())
    elif code == 0 and spec.cluster.task is not None and spec.cluster.task.type != "chief":
        console.print(f"{spec.cluster.task.type}:{spec.cluster.task.index} done; the chief ({spec.cluster.master_addr}) "
                      f"wrote the results; this task's logs: {run_dir / 'logs'}")
    elif code == 0 and spec.cluster.node_rank:
        console.print(f"node {spec.cluster.node_rank} of {spec.cluster.nodes} done; rank 0 wrote the results on node 0 "
                      f"({spec.cluster.master_addr}); this node's worker logs: {run_dir / 'logs'}")
    return summary


def _optimizing_sweeper() -> bool:
    """Optuna's sweeper wants a number back from each job."""
    from hydra.core.hydra_config import HydraConfig

    return "optuna" in str(HydraConfig.get().sweeper.get("_target_", "")).lower()


def _checkpoint_dir_writable(spec: Any, run_dir: Path) -> None:
    root = spec.trainer.checkpoint.root(run_dir)
    why = _unusable_dir(str(root)) if spec.trainer.checkpoint.every_steps else None
    if why:
        raise ConfigError([Problem(key="trainer.checkpoint.dir", value=str(root), message=why)])


def _checkpoints_usable(spec: Any, run_dir: Path) -> Path | None:
    """The checkpoint to resume from (None: none), verified; else ConfigError.

    Each damaged checkpoint passed over gets one warning line; when every one found is damaged, nothing starts.
    """
    root = spec.trainer.checkpoint.root(run_dir)
    if spec.trainer.resume == "never" or (spec.trainer.resume == "auto" and not root.exists()):
        return None  # nothing to read: no need for torch.distributed.checkpoint in this process
    from launcher import checkpoint
    from launcher.checkpoint.errors import START_AFRESH

    try:
        choice = checkpoint.select(spec, run_dir)
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


def _resuming_from(spec: Any, path: Path | None) -> Any:
    """The spec the workers get: ``trainer.resume`` names the checkpoint verified here, so they choose nothing again."""
    if path is None:
        return spec
    return spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"resume": str(path)})})


def _hydra_main(argv: list[str]) -> None:
    import hydra

    main_fn = hydra.main(config_path=str(composer.CONF_DIR), config_name="config", version_base="1.3")(task)
    saved = sys.argv
    sys.argv = ["dlaunch", *argv]
    try:
        main_fn()
    finally:
        sys.argv = saved



# `dlaunch NAME ...` for these names runs a tool, not a training job.
SUBCOMMANDS = {"recipes": "launcher.cli.recipes", "report": "launcher.cli.report", "resume": "launcher.cli.resume"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    answered = usage.early_exit(argv)  # --help, --version, torchrun-style flags
    if answered is not None:
        return answered
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    argv, script_config.ARGS[:] = script_config.split_argv(argv)  # `-- ARGS`: the script's, not Hydra's
    args = _hydra_args(argv)
    composer.CONFIG_DIRS[:] = [os.path.abspath(args.config_dir)] if args.config_dir else []
    composer.CONFIG_NAME = args.config_name or "config"
    informational = args.help or args.hydra_help or args.info or args.shell_completion
    try:
        composer.primary_config_usable(args.config_path, args.config_name)
        chosen = composer.choose_user_recipes(args.overrides)
        argv = [dict(zip(args.overrides, chosen)).get(a, a) for a in argv] + chosen[len(args.overrides):]
        args.overrides = chosen
        if informational:
            composer.register_configs(args.overrides)
        else:
            precheck(args.overrides, args.multirun)
            if not args.multirun:
                _warm_workers(args.overrides)
            if _Status.validated and all(s.launch.dry_run for s in _Status.validated.values()):
                argv.append("hydra.output_subdir=null")  # a preview: Hydra's record of an existing run stays as it was
    except ConfigError as exc:
        if full_errors():
            raise
        render(exc)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    _Status.codes, _Status.stopped = [], ""
    launcher = scheduled.launcher_of(args.overrides)
    if launcher and not informational:
        if not args.multirun:  # Hydra runs a job through its launcher plugin only in multirun mode
            argv = ["-m", *argv]
        try:
            extra = scheduled.submission(launcher, args.overrides, list(_Status.validated.values()))
        except ConfigError as exc:
            render(exc)
            return 2
        if extra is None:  # a dry run on SLURM: its plan and request shown, nothing submitted
            return 0
        argv += extra
    try:
        _hydra_main(argv)
    except SystemExit as exc:  # Hydra reported a scheduled job's failure (JobFailed) in one line
        if not launcher:
            raise
        return exc.code if isinstance(exc.code, int) else 1
    codes = [*_Status.codes, *([1] if (args.multirun or launcher) and sweep.failed_jobs() else [])]  # jobs run elsewhere too
    return max(codes, default=0, key=_severity)


def _severity(code: int) -> tuple[int, int]:
    """A signal outranks a failure, a failure outranks a config error."""
    return (code >= 128, code == 1, code)


if __name__ == "__main__":
    from launcher.cli.entry import leave

    leave(main())
