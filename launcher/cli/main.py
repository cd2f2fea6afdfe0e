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
import json
import logging
import os
import signal
import sys
from typing import Any

from hydra.core.override_parser.types import Override
from rich.console import Console

from launcher.cli import interrupts, job, scheduled, sweep, sweep_jobs, sweep_stop, usage
from launcher.cluster.env import full_errors, tf_config
from launcher.config import compose as composer
from launcher.config import disk
from launcher.config import script as script_config
from launcher.config import user_recipes
from launcher.config.errors import ConfigError, Problem, RecipeBesideScript, render
from launcher.config.task_overrides import TASK_ROLES

MAX_PRECHECKED_JOBS = 64
NO_HYDRA_RECORD = "hydra.output_subdir=null"  # Hydra writes .hydra/ before the job can refuse: the job writes it
REMOTE_CUDA = 1 << 16  # validating for another machine: assume it has the devices asked for


def _hydra_args(argv: list[str]) -> Any:
    """Hydra's flags and overrides, in any order (``dlaunch trainer.steps=5 --cfg job``): Hydra's own parser reads
    overrides only after the last flag."""
    from hydra._internal.utils import get_args_parser  # the parser hydra.main itself uses

    return get_args_parser().parse_intermixed_args(argv)


def _flags_first(argv: list[str], overrides: list[str]) -> list[str]:
    """``argv`` as Hydra's parser reads it: the flags (with their values), then every override. A bare ``--info``
    becomes ``--info=all``: moved before the overrides, it would take the first one for its value."""
    flags = list(argv)
    for override in overrides:
        flags.remove(override)
    flags = ["--info=all" if f in usage.INFO and (i + 1 == len(flags) or flags[i + 1] not in usage.INFO_CHOICES) else f
             for i, f in enumerate(flags)]
    return [*flags, *overrides]


def _job_overrides(overrides: list[str], parsed: list[Override] | None) -> list[list[str]]:
    """The concrete override lists a run or sweep will compose (choice sweeps expanded); ``parsed``: a sweep's
    ``overrides`` as ``composer.parse_overrides`` read them, None for one run."""
    if parsed is None:
        return [overrides]
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


def _unlisted_jobs(parsed: list[Override]) -> bool:
    """A sweep (its parsed overrides) with jobs ``_job_overrides`` does not list: a range or interval axis, or a
    sweeper's own search."""
    return any(ov.is_sweep_override() and not ov.is_choice_sweep() for ov in parsed) or any(
        ov.key_or_group == "hydra/sweeper" for ov in parsed)


_OUTPUT_DIRS = ("hydra.run.dir", "hydra.sweep.dir")


def _check_output_dirs(overrides: list[str]) -> list[Problem]:
    """An empty run directory would scatter a run's files into the current directory; a file cannot hold them."""
    problems = []
    for text in overrides:
        key, _, value = text.partition("=")
        key, value = key.lstrip("+"), value.strip().strip("'\"")
        if key not in _OUTPUT_DIRS:
            continue
        why = "must name a directory" if not value else disk.unusable_dir(value)
        if why:
            problems.append(Problem(key=key, value=value, message=why))
    return problems


def precheck(overrides: list[str], multirun: bool) -> sweep_jobs.Checked:
    """Compose and validate every job before anything starts; raise ConfigError."""
    composer.register_configs(overrides)
    # A SLURM job runs on nodes this machine cannot see: their devices are checked there.
    cuda = REMOTE_CUDA if scheduled.launcher_of(overrides) == "submitit_slurm" else job.cuda_devices()
    problems: list[Problem] = _check_output_dirs(overrides)
    parsed = composer.parse_overrides(overrides) if multirun else None  # once, for both questions about the sweep
    checked = sweep_jobs.check({job.job_key(o): o for o in _job_overrides(overrides, parsed)}, cuda, multirun,
                               unlisted=parsed is not None and _unlisted_jobs(parsed))
    job.Status.validated.update({key: spec for key, spec in checked.valid.items() if not spec.deferred})  # others: in the job
    job.Status.invalid = checked.invalid  # a sweep's invalid combinations: each becomes a failed job with its reason
    problems.extend(p for p in checked.up_front if p not in problems)
    if problems:
        raise checked.error(problems)
    return checked


def _every_problem(overrides: list[str], multirun: bool) -> list[str]:
    """``overrides`` with the user's recipes chosen; a recipe beside a script is refused on one screen with the other
    overrides' problems."""
    try:
        return composer.choose_user_recipes(overrides)
    except RecipeBesideScript as exc:
        try:
            precheck(composer.choose_user_recipes(exc.rest), multirun)
        except ConfigError as more:
            raise ConfigError([*exc.problems, *more.problems]) from None
        raise


def _warm_workers(overrides: list[str], multirun: bool, checked: sweep_jobs.Checked) -> None:
    """Keep the forkserver that imports the workers (``launcher/launch/warm.py``) only for local CPU workers: a lone
    run's, or those of a sweep's jobs run one after the other here (each job asks again as it starts, cli/job.py)."""
    from launcher.launch import warm

    specs = [spec for spec in job.Status.validated.values() if not spec.launch.dry_run]
    # jobs validated only as they run: a sweeper's, those past the pre-check's first jobs, a config that needs Hydra's
    undecided = checked.unlisted or len(checked.valid) + len(checked.invalid) >= MAX_PRECHECKED_JOBS or any(
        spec.deferred and not spec.launch.dry_run for spec in checked.valid.values())
    if scheduled.launcher_of(overrides) is not None or not _jobs_here(overrides) or not (specs or multirun and undecided):
        warm.stop()
    elif multirun:
        warm.keep_for_sweep(specs, job.cuda_devices(), undecided)
    elif len(specs) == 1:
        warm.keep_if_useful(specs[0], job.cuda_devices())
    else:
        warm.stop()


class _RecipeAsTyped(logging.Filter):
    """Hydra's launcher line for each sweep job (``#0 : recipe=user/mine ...``) with the recipe as the user typed it:
    ``user/NAME`` is the option dlaunch stored it under, which means nothing to them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for option, typed in user_recipes.TYPED.items():
            message = message.replace(f"recipe={option}", f"recipe={typed}")
        record.msg, record.args = message, ()
        return True


_AS_TYPED = _RecipeAsTyped()


def _hydra_main(argv: list[str]) -> None:
    import hydra

    logging.getLogger("hydra._internal.core_plugins.basic_launcher").addFilter(_AS_TYPED)  # once: the same object
    main_fn = hydra.main(config_path=str(composer.CONF_DIR), config_name="config", version_base="1.3")(job.task)
    saved = sys.argv
    sys.argv = ["dlaunch", *argv]
    try:
        main_fn()
    finally:
        sys.argv = saved


# `dlaunch NAME ...` for these names runs a tool, not a training job.


SUBCOMMANDS = {"recipes": "launcher.cli.recipes", "report": "launcher.cli.report", "resume": "launcher.cli.resume"}


def _say_tf_config_not_read(overrides: list[str]) -> None:
    """A ``TF_CONFIG`` in the environment (a TF habit, a Kubernetes TFJob's) is not dlaunch's cluster: the plan's is,
    in every process. Said once, with the ``cluster=tasks`` overrides that run the cluster it lists."""
    try:
        config = tf_config()
    except ValueError:
        config = {"cluster": {}}
    if not config or any(composer.key_of(o) == "cluster" and "tasks" in o.partition("=")[2]
                         or composer.key_of(o).startswith("cluster.tasks") for o in overrides):
        return  # a task list given to dlaunch
    roles = {role: list(config.get("cluster", {}).get(role, [])) for role in TASK_ROLES}
    given = ", ".join(f"{role}: {json.dumps(hosts)}" for role, hosts in roles.items() if hosts)
    task = config.get("task") or {}
    which = f" 'cluster.task={{type: {task['type']}, index: {task.get('index', 0)}}}'" if task.get("type") else ""
    print(f"dlaunch: TF_CONFIG is set in this environment, but dlaunch's cluster is its config's, in every process "
          f"(TF_CONFIG is not read); its cluster as dlaunch's: cluster=tasks 'cluster.tasks={{{given}}}'{which}"
          if given else "dlaunch: TF_CONFIG is set in this environment, but dlaunch's cluster is its config's (TF_CONFIG"
          " is not read; cluster=tasks takes a task list)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    answered = usage.early_exit(argv)  # --help, --version, torchrun-style flags
    if answered is not None:
        return answered
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        stopped = interrupts.hand_over() if argv[0] != "resume" else 0  # resume runs main() again, which hands over later
        if stopped:
            return stopped
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    argv, script_config.ARGS[:] = script_config.split_argv(argv)  # `-- ARGS`: the script's, not Hydra's
    if misplaced := script_config.like_settings(script_config.ARGS):
        print(f"dlaunch: {' '.join(misplaced)} after -- go to the script as its own arguments, not to dlaunch; "
              "dlaunch's settings go before --", file=sys.stderr)
    args = _hydra_args(argv)
    argv = _flags_first(argv, args.overrides)
    _say_tf_config_not_read(args.overrides)
    composer.CONFIG_DIRS[:] = [os.path.abspath(args.config_dir)] if args.config_dir else []
    composer.CONFIG_NAME = args.config_name or "config"
    informational = args.help or args.hydra_help or args.info or args.shell_completion
    try:
        composer.primary_config_usable(args.config_path, args.config_name)
        chosen = _every_problem(script_config.path_beside_keys(args.overrides), args.multirun)
        argv = [dict(zip(args.overrides, chosen)).get(a, a) for a in argv] + chosen[len(args.overrides):]
        args.overrides = chosen
        if informational:
            composer.register_configs(args.overrides)
        else:
            checked = precheck(args.overrides, args.multirun)
            _warm_workers(args.overrides, args.multirun, checked)
            dry = any(spec.launch.dry_run for spec in checked.valid.values())
            if args.multirun and not args.cfg and not dry:  # a sweep's jobs will run
                sweep_jobs.announce_invalid(checked, Console(emoji=False, stderr=True))
            argv.append(NO_HYDRA_RECORD)  # the job writes Hydra's record itself, once it goes ahead (cli/job.py)
    except ConfigError as exc:
        if full_errors():
            raise
        render(exc)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # a second stop signal while the config was read (interrupts.Stopped: SIGTERM's)
        return getattr(exc, "exit_code", 130)
    job.Status.codes, job.Status.stopped, job.Status.here = [], "", True
    launcher = scheduled.launcher_of(args.overrides)
    if launcher and not informational:
        if not args.multirun:  # Hydra runs a job through its launcher plugin only in multirun mode
            argv = ["-m", *argv]
        try:
            extra = scheduled.submission(launcher, args.overrides, list(job.Status.validated.values()))
        except ConfigError as exc:
            render(exc)
            return 2
        if extra is None:  # a dry run on SLURM: its plan and request shown, nothing submitted
            return 0
        argv += extra
    stopped = _interrupted_before_start(launcher) if not informational else 0
    if stopped:
        return stopped
    return _run(argv, args.multirun, args.overrides, launcher)


def _run(argv: list[str], multirun: bool, overrides: list[str], launcher: str | None) -> int:
    """Hydra runs the job, or the sweep's jobs; the exit code of them all."""
    try:
        with _stop_handling(multirun, overrides, launcher):
            _hydra_main(argv)
            late = interrupts.take_noted()  # after the last job started: the sweep's table is shown all the same
            elsewhere = sweep_stop.taken()  # while other processes ran the jobs
    except SystemExit as exc:  # Hydra reported a scheduled job's failure (JobFailed) in one line
        if not launcher:
            raise
        return exc.code if isinstance(exc.code, int) else 1
    codes = [*job.Status.codes]
    if multirun or launcher:  # jobs run elsewhere too: the sweep's table read their directories
        codes += [*([1] if sweep.failed_jobs() else []), sweep.stopped_code()]
    if late is not None:
        print(f"dlaunch: stopped by {signal.Signals(late).name} after the sweep's last job had started", file=sys.stderr)
        codes.append(128 + late)
    elif elsewhere is not None:
        print(f"dlaunch: stopped by {signal.Signals(elsewhere).name}; the table above says how each of the sweep's jobs "
              "ended", file=sys.stderr)
        codes.append(128 + elsewhere)
    return max(codes, default=0, key=_severity)


def _stop_handling(multirun: bool, overrides: list[str], launcher: str | None) -> Any:
    """How dlaunch takes a stop signal while Hydra runs: a sweep whose jobs run here notes it between them; one whose
    jobs run in other processes (joblib's, submitit's) stops the jobs not started; a lone run raises it until it
    records itself (cli/job.py)."""
    if launcher or (multirun and not _jobs_here(overrides)):
        return sweep_stop.noting()
    return interrupts.between_jobs() if multirun else interrupts.stops_raise()


def _jobs_here(overrides: list[str]) -> bool:
    """A sweep's jobs run one after the other in this process (Hydra's basic launcher, not joblib's or SLURM's)."""
    return all(o.partition("=")[2] in ("", "basic") for o in overrides if o.partition("=")[0].lstrip("+") == "hydra/launcher")


def _interrupted_before_start(launcher: str | None) -> int:
    """Ctrl-C handling goes back to Python's, and then the run's (interrupts.py); the exit code of a stop signal that
    came before (0: none).

    A job that trains in this process, or starts its workers from it, needs torch: imported first, while a
    Ctrl-C is still only noted, since one raised inside that import could be lost there.
    """
    running = [spec for spec in job.Status.validated.values() if not spec.launch.dry_run]
    if launcher is None and running:
        from launcher.cluster import env
        from launcher.launch.warm import quiets_cpp

        if any(quiets_cpp(spec) for spec in running):
            env.quiet_cpp_warnings()
        else:  # the console script guessed several nodes from the command line: the workers need not inherit it
            env.unquiet_cpp_warnings()
        import torch  # noqa: F401

    return interrupts.hand_over()


def _severity(code: int) -> tuple[int, int]:
    """A signal outranks a failure, a failure outranks a config error."""
    return (code >= 128, code == 1, code)


if __name__ == "__main__":
    from launcher.cli.entry import leave

    leave(main())
