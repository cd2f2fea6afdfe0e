"""``dlaunch resume RUN_DIR [KEY=VALUE ...]``: run a stopped run again, in its own directory, from its newest checkpoint.

The default run directory has a timestamp in its name, so "the same command
again" would start afresh elsewhere. This reads the run's own overrides
(``RUN_DIR/.hydra/overrides.yaml``), ``--config-dir`` and ``--config-name``, and runs them with
``hydra.run.dir=RUN_DIR trainer.resume=auto``, from the directory the run was started in; further
overrides are added last. A script's run gets its arguments (after ``--``) again, unless new ones are given.

    dlaunch resume outputs/2026-01-02/10-11-12
    dlaunch resume outputs/2026-01-02/10-11-12 trainer.steps=500
    dlaunch resume outputs/2026-01-02/10-11-12 -- --epochs 5   # a script's run, with new arguments
    dlaunch resume multirun/2026-01-02/10-11-12     # a sweep: every job, each from its own checkpoint

A sweep directory runs the sweep's overrides again (``-m``, ``hydra.sweep.dir=SWEEP_DIR``): a stopped job
resumes, the jobs not started start, and a completed job has nothing left to train. Overrides added go to every
job; a new value for a key the sweep sweeps is refused (it cannot replace each job's own): ``SWEEP_DIR/N`` takes it.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

from launcher.cli.resume_lines import command
from launcher.config.errors import ConfigError
from launcher.config.overrides import key_of


SWEEP_FILE = "multirun.yaml"  # what Hydra writes at the top of a sweep's directory
ADDED = "trainer.resume=auto"  # what a resume adds to the job it replays (the default): no override of the job's own


def _config_args(hydra_yaml: Path) -> list[str]:
    """``--config-dir DIR`` for each directory the run was given, and ``--config-name NAME`` where it named its own."""
    from omegaconf import OmegaConf

    if not hydra_yaml.exists():
        return []
    hydra = OmegaConf.load(hydra_yaml).hydra
    sources = hydra.runtime.get("config_sources", [])
    dirs = [arg for s in sources if s.provider == "command-line" and s.schema == "file" for arg in ("--config-dir", str(s.path))]
    name = hydra.job.get("config_name")
    return [*dirs, *(["--config-name", str(name)] if name and name != "config" else [])]


def keep_replayable(run_dir: Path) -> None:
    """Hydra wrote the job's (or sweep's) overrides as it got them: a user recipe's stored option becomes what the
    user typed, while this process still knows it."""
    from omegaconf import OmegaConf

    from launcher.config import user_recipes

    from launcher.runtime import outputs

    job, sweep = run_dir / outputs.HYDRA_RECORD / "overrides.yaml", run_dir / SWEEP_FILE
    if not user_recipes.TYPED:
        return
    if job.exists():
        own = [str(o) for o in OmegaConf.load(job)]
        if (typed := user_recipes.as_typed(own)) != own:
            OmegaConf.save(OmegaConf.create(typed), job)
    if sweep.exists():
        record = OmegaConf.load(sweep)
        task = OmegaConf.select(record, "hydra.overrides.task", default=None)  # None: not a record Hydra wrote
        own = [str(o) for o in task or ()]
        if task is not None and (typed := user_recipes.as_typed(own)) != own:
            record.hydra.overrides.task = typed
            OmegaConf.save(record, sweep)


def _no_such_dir(run_dir: Path) -> str:
    """``dlaunch resume multirun/nope``: what is missing, and the nearest name beside it (a typo)."""
    from launcher.config.errors import did_you_mean

    if run_dir.exists():  # a file: its run is the directory it is in
        return f"{run_dir}: a file, not a run directory" + (
            f"; did you mean {run_dir.parent}?" if (run_dir.parent / ".hydra").is_dir() else "")
    near = [d.name for d in run_dir.parent.iterdir() if d.is_dir()] if run_dir.parent.is_dir() else []
    meant = did_you_mean(run_dir.name, near)
    return f"{run_dir}: no such directory" + (f"; did you mean {run_dir.parent / meant}?" if meant else "")


def rerun_args(run_dir: Path, extra: list[str]) -> list[str]:
    """The arguments that run ``run_dir``'s job (or sweep) again there; ValueError naming what is missing."""
    from omegaconf import OmegaConf

    from launcher.config import script as script_config
    from launcher.config import user_recipes
    from launcher.runtime import outputs

    given = script_config.SEPARATOR in extra  # `dlaunch resume RUN -- ARGS`: a script's new arguments
    extra, args = script_config.split_argv(extra)
    hydra_dir = run_dir / outputs.HYDRA_RECORD
    if (run_dir / SWEEP_FILE).exists() and not hydra_dir.exists():  # a sweep: every job again, each from its checkpoint
        # unresolved: ${hydra:job.num} means each job's own number again, in the sweep that replays it
        recorded = OmegaConf.to_container(OmegaConf.load(run_dir / SWEEP_FILE).hydra.overrides, resolve=False)
        own = user_recipes.as_typed([str(o) for o in recorded["task"]])
        _refuse_swept_values(run_dir, [*own, *map(str, recorded["hydra"])], extra, [*extra, *_script_tail(args)])
        hydra_own = [str(o) for o in recorded["hydra"]
                     if key_of(str(o)) not in ("hydra.sweep.dir", "hydra.run.dir", "hydra.mode", "hydra.output_subdir")]
        jobs = sorted(run_dir.glob(f"*/{outputs.HYDRA_RECORD}/{outputs.SCRIPT_ARGS}"))  # the same in every job
        return [*_config_args(run_dir / SWEEP_FILE), "-m", *hydra_own, *_rerun(own, extra), f"hydra.sweep.dir={run_dir}",
                *_script_tail(args if given else _recorded(jobs))]
    if not run_dir.is_dir():
        raise ValueError(_no_such_dir(run_dir))
    if not (hydra_dir / "overrides.yaml").exists() and (run_dir / outputs.SWEEP_SUMMARY).is_file():
        jobs = sorted((d for d in run_dir.iterdir() if d.name.isdigit() and (d / outputs.HYDRA_RECORD).is_dir()
                       and (outputs.read_summary(d) or {}).get("status") != "completed"), key=lambda d: int(d.name))
        raise ValueError(f"{run_dir} is a sweep of an optimizing sweeper (Optuna): its study lived in the sweep's "
                         "process and cannot be replayed; resume a stopped job alone (its row in the sweep's summary "
                         f"is updated): {' or '.join(command(j) for j in jobs[:3]) or 'dlaunch resume SWEEP_DIR/N'}, "
                         "or run the sweep again for a new study")
    if not (hydra_dir / "overrides.yaml").exists():
        raise ValueError(f"{run_dir} is not a dlaunch run or sweep directory: neither {hydra_dir / 'overrides.yaml'} "
                         f"nor {run_dir / SWEEP_FILE} exists")
    from launcher.checkpoint import lock  # torch: not for the answers that need none

    shared = lock.other_nodes_here(run_dir)
    which = [o for o in extra if key_of(o) == "cluster.node_rank" or key_of(o).startswith("cluster.task")]
    if shared and not which:  # its record is node 0's command
        raise ValueError(f"{run_dir} is shared by the nodes of a multi-node run (node 0 and {', '.join(shared)}): say "
                         f"which this machine is, `{command(run_dir)} cluster.node_rank=N` (0 on node 0; "
                         "cluster.task='{type: worker, index: I}' for a task list)")
    token = run_dir / outputs.STATE_DIR / outputs.TOKEN  # node 0's: the other nodes give it to be admitted
    if shared and token.is_file() and not any(key_of(o) == "cluster.token" for o in extra) and \
            not any(o.partition("=")[2].strip() in ("0", "") for o in which if key_of(o) == "cluster.node_rank"):
        extra = [*extra, f"cluster.token={token.read_text().strip()}"]
    own = _pinned([str(o) for o in OmegaConf.load(hydra_dir / "overrides.yaml")], run_dir / outputs.CONFIG)
    return [*_config_args(hydra_dir / "hydra.yaml"), *_rerun(own, extra, _resumes_from(run_dir, own)), f"hydra.run.dir={run_dir}",
            *_script_tail(args if given else _recorded([hydra_dir / outputs.SCRIPT_ARGS]))]


def _refuse_swept_values(sweep_dir: Path, recorded: list[str], extra: list[str], given: list[str]) -> None:
    """ValueError where ``extra`` gives a new value to a key the sweep sweeps: one value cannot replace each job's
    own (the jobs would no longer differ in it, while the completed ones keep what their own values trained), and
    Hydra's sweep would then have fewer jobs, numbered afresh (job 0 alone ran; a failed job 1 was dropped).
    The message names the command that gives the value to one job (``given``: what was typed after the directory)."""
    from launcher.config import compose as composer
    from launcher.config.errors import ConfigError
    from launcher.config.user_recipes import as_shown
    from launcher.runtime import outputs

    params = "hydra.sweeper.params."  # an Optuna search space given as Hydra's setting
    try:
        parsed = composer.parse_overrides([o for o in recorded if not key_of(o).startswith(params)])
    except ConfigError:
        return  # the sweep's own record: its replay says what does not parse
    swept = {key_of(o.input_line): o.input_line for o in parsed if o.is_sweep_override()}
    swept.update({key_of(o).removeprefix(params): o for o in recorded if key_of(o).startswith(params)})
    clash = [swept[key_of(o)] for o in extra if key_of(o) in swept and o.lstrip("+") != swept[key_of(o)].lstrip("+")]
    if not clash:
        return
    jobs = sorted((d for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
    left = [(d, status) for d in jobs if (status := (outputs.read_summary(d) or {}).get("status")) != "completed"]
    typed = " ".join(shlex.quote(a) for a in given)
    lines = "\n".join(f"  dlaunch resume {shlex.quote(str(d))} {typed}   (job {d.name}: {status or 'no record'})"
                      for d, status in left) or f"  dlaunch resume {shlex.quote(str(sweep_dir))}/N {typed}"
    keys = "; ".join(f"{key_of(s)} is swept by this sweep ({as_shown([s])[0]})" for s in clash)
    raise ValueError(
        f"{keys}: one value cannot replace each job's own (the jobs would no longer differ in it, and a completed "
        f"job keeps what its own value trained). Resume the job that needs the new value on its own; it goes on from "
        f"its newest checkpoint, and its row of the sweep's summary is updated:\n{lines}\n"
        f"({command(sweep_dir)} KEY=VALUE gives every job a key the sweep does not sweep: a fix, trainer.steps=N)")


def _pinned(own: list[str], config: Path) -> list[str]:
    """``own`` with each interpolated value (``trainer.checkpoint.dir=/ckpt/${hydra:job.num}``, which a sweep's job
    records escaped) replaced by what it resolved to in the job, from its ``config.yaml``: run alone, the job has
    no job number, and it would look for its checkpoints elsewhere and train again from step 0."""
    from omegaconf import OmegaConf

    interpolated = [o for o in own if "${" in o or "$\\{" in o]
    if not interpolated or not config.is_file():
        return own
    resolved = OmegaConf.load(config)
    pinned = []
    for o in own:
        value = OmegaConf.select(resolved, key_of(o), default=None) if o in interpolated else None
        if isinstance(value, str) and not re.fullmatch(r"[\w./@+-]+", value):  # Hydra's grammar: quoted, escaped
            value = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        pinned.append(f"{o.split('=', 1)[0]}={value}" if isinstance(value, (str, int, float, bool)) else o)
    return pinned


def _recorded(records: list[Path]) -> list[str]:
    """The arguments (after ``--``) a script's run was given, from the first of ``records`` that exists."""
    import json

    found = [r for r in records if r.exists()]
    return [str(a) for a in json.loads(found[0].read_text())] if found else []


def _script_tail(args: list[str]) -> list[str]:
    from launcher.config import script as script_config

    return [script_config.SEPARATOR, *args] if args else []


def _resumes_from(run_dir: Path, own: list[str]) -> str:
    """``auto`` (the run's newest checkpoint); but a fine-tune (``trainer.resume=PATH``) that has saved no checkpoint
    of its own yet starts from PATH again, not from step 0."""
    from omegaconf import OmegaConf

    from launcher.checkpoint import layout
    from launcher.config.trainer import CheckpointSpec
    from launcher.runtime import outputs

    recorded = next((o.split("=", 1)[1] for o in reversed(own) if key_of(o) == "trainer.resume"), "auto")
    if recorded in ("auto", "never") or not (run_dir / outputs.CONFIG).is_file():
        return "auto"
    own_dir = OmegaConf.select(OmegaConf.load(run_dir / outputs.CONFIG), "trainer.checkpoint.dir", default=None)
    root = CheckpointSpec(dir=own_dir).root(run_dir)  # where the run saved, as the run itself chose it
    return "auto" if layout.choose(root, full=False).path is not None else recorded


def _rerun(own: list[str], extra: list[str], resume: str = "auto") -> list[str]:
    """The run's own overrides, each that ``extra`` sets replaced where it stood (a sweep numbers its jobs in that
    order), resuming from the newest checkpoint (``resume``); never a dry run (``dlaunch resume RUN
    launch.dry_run=true`` previews one resume, not the ones after it)."""
    given = {key_of(o): o for o in extra}
    mine = set(given)
    kept = []
    for o in own:  # a key given twice (the later one won): extra's value takes the first place, the rest go
        if key_of(o) in given:
            kept.append(given.pop(key_of(o)))
        elif key_of(o) not in (*mine, "trainer.resume", "launch.dry_run"):
            kept.append(o)
    return [*kept, *given.values(), *([] if "trainer.resume" in mine else [f"trainer.resume={resume}"])]


RESUMING: list[bool] = []  # set by `dlaunch resume`: a completed run with nothing to resume from is kept, not retrained


def already_completed(spec: Any, run_dir: Path, resume_from: Path | None = None, same_run: bool = False) -> dict | None:
    """The run's completed summary when it ran its ``trainer.steps`` and this command would train nothing: under
    ``dlaunch resume``, or its own command again (``same_run``: the same config, one node) with the checkpoint of its
    last step to go on from (a sweep run again into its directory). With no checkpoint (checkpoints were off)
    training it again from step 0 would replace its results; from its last checkpoint there is nothing left to
    train, and its summary's throughput and wall time stand (a re-run replaced them with those of no step)."""
    from launcher.checkpoint import layout
    from launcher.runtime import outputs

    try:
        last = (same_run and resume_from is not None and spec.script is None
                and layout.step_of(resume_from) == spec.trainer.steps)
    except AttributeError:  # a trainer.resume=PATH not named step-N
        last = False
    summary = outputs.read_summary(run_dir) if (RESUMING or last) and outputs.completed(run_dir) else None
    return summary if summary is not None and summary.get("steps") == spec.trainer.steps else None


class CompletedRunKept(ConfigError):
    """A resume refused so that the completed run in its directory stays as it was: a sweep's table keeps its row."""


def refuse_training_again(spec: Any, run_dir: Path, resume_from: Path | None) -> None:
    """Under ``dlaunch resume``: a completed run with no checkpoint of its own to go on from (a longer or shorter
    ``trainer.steps``) is not trained again over its own results, from step 0 or from the checkpoint a fine-tune
    started from: ConfigError, nothing written. A script restores its own checkpoints, and ``trainer.resume=never``
    asks for a fresh start: both go ahead."""
    from launcher.config.errors import Problem
    from launcher.runtime import outputs

    root = spec.trainer.checkpoint.root(run_dir)
    own = resume_from is not None and root.resolve() in Path(resume_from).resolve().parents
    if not RESUMING or own or spec.script is not None or spec.trainer.resume == "never" or not outputs.completed(run_dir):
        return
    summary = outputs.read_summary(run_dir) or {}
    why = "checkpoints are off (trainer.checkpoint.every_steps=0)" if not spec.trainer.checkpoint.every_steps else \
        f"none is in {root}"
    start = "step 0" if resume_from is None else f"{resume_from}, where it started"
    raise CompletedRunKept([Problem(key="trainer.steps", value=spec.trainer.steps, message=(
        f"{run_dir} completed {summary.get('steps', 'its')} steps with no checkpoint of its own ({why}): a resume "
        f"would train it again from {start} over its results. For {spec.trainer.steps} steps: a new run, or "
        "trainer.resume=never here (with trainer.checkpoint.every_steps=N a run can be resumed to train longer)"))])


def _go_to_first_cwd(run_dir: Path) -> str:
    """Into the directory the run was first started from (Hydra records it), so that relative paths in its command
    (``script=train.py``, ``input.files=data/*.jsonl``) mean what they meant then; ``cd DIR && `` when that moved."""
    import os

    from omegaconf import OmegaConf

    from launcher.runtime import outputs

    records = [r for r in (run_dir / outputs.HYDRA_RECORD / "hydra.yaml", run_dir / SWEEP_FILE) if r.exists()]
    first = OmegaConf.select(OmegaConf.load(records[0]), "hydra.runtime.cwd") if records else None
    if not first or Path(first) == Path.cwd():
        return ""
    if not Path(first).is_dir():
        print(f"dlaunch resume: {first}, where the run was started, is gone: relative paths in its command are read "
              f"from {Path.cwd()}", file=sys.stderr)
        return ""
    os.chdir(first)
    return f"cd {shlex.quote(first)} && "


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        text = __doc__.strip().split("\n\n")[0].replace("``", "`")
        print(text + "\n\nusage: dlaunch resume RUN_OR_SWEEP_DIR [KEY=VALUE ...] [-- SCRIPT_ARGS]",
              file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    run_dir = Path(argv[0]).expanduser().resolve()
    try:
        args = rerun_args(run_dir, argv[1:])
    except ValueError as exc:
        print(f"dlaunch resume: {exc}", file=sys.stderr)
        return 2
    where = _go_to_first_cwd(run_dir)
    shown = [f"{key_of(a)}=***" if key_of(a) == "cluster.token" else a for a in args]  # a secret: not on the terminal
    print(where + "dlaunch " + " ".join(shlex.quote(a) for a in shown), file=sys.stderr)
    RESUMING.append(True)
    from launcher.cli import sweep
    from launcher.cli.main import main as run
    from launcher.launch import warm
    from launcher.runtime import outputs

    warm.start_for_resume(args)  # its workers fork from a warm server as the run's own command's did
    code = run(args)
    dry = any(key_of(a) == "launch.dry_run" and a.partition("=")[2].strip().lower() == "true" for a in args)
    if code != 2 and not dry and not (run_dir / SWEEP_FILE).exists() and sweep.update_row(run_dir):  # one job of a sweep
        print(f"job {run_dir.name}'s row of {run_dir.parent / outputs.SWEEP_SUMMARY} (and .csv) is updated",
              file=sys.stderr)
    return code
