"""A dry run (``launch.dry_run=true``) leaves nothing behind: the run or sweep directory made for it goes again.

The job writes nothing in a dry run (``cli/job.py``, ``checkpoint/lock.py``), but Hydra makes the run
directory before the job runs, and the launcher's log (``dlaunch.log``) in it; a sweep also gets its
``multirun.yaml`` and a directory per job. This Hydra callback (``hydra.callbacks.dry_run`` in
``conf/config.yaml``) notes which directories are not there yet when the run (or sweep) starts and,
after a dry run, removes them, but only where they hold nothing else: a directory that was there before
(``dlaunch resume RUN launch.dry_run=true``) stays, and so does one in which anything else turned up
(another command's run, started in the same second; a sweep's refused jobs, which record why).

    dlaunch recipe=linear launch.dry_run=true     # the plan; no outputs/DATE/TIME afterwards
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from launcher.cli import resume


class LeaveNothing(Callback):
    """Removes the directories Hydra made for a dry run (those missing when it started, innermost first)."""

    def __init__(self) -> None:
        self.made: list[Path] = []

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self.made = _missing(Path(config.hydra.run.dir))

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        if not self.made or not is_dry_run(config) or not self.made[0].is_dir():
            return
        if _only_logs(self.made[0], _log_name(config)):
            _remove(self.made, _log_name(config))

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.made = _missing(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """A sweep's directory goes where it holds Hydra's ``multirun.yaml`` and job directories with only a log."""
        if not self.made or not is_dry_run(config) or not self.made[0].is_dir():
            return
        sweep, log_name = self.made[0], _log_name(config)
        jobs = [p for p in sweep.iterdir() if p.name != resume.SWEEP_FILE]
        if all(p.is_dir() and _only_logs(p, log_name) for p in jobs):
            for job in jobs:
                _remove([job], log_name)
            (sweep / resume.SWEEP_FILE).unlink(missing_ok=True)
            _remove(self.made, log_name)


def _missing(directory: Path) -> list[Path]:
    """``directory`` and its parents that are not there yet (those Hydra will make), innermost first."""
    directory = directory.absolute()  # Hydra may enter the run directory (hydra.job.chdir) before the run ends
    return [p for p in (directory, *directory.parents) if not p.exists()]


def is_dry_run(config: Any) -> bool:
    """Whether a job's config (or the run's, with its ``hydra`` section) asks for a dry run."""
    return OmegaConf.select(config, "launch.dry_run", default=False) is True


def _log_name(config: Any) -> str:
    """The launcher's log in each run directory (``conf/hydra/job_logging``, as Hydra's own default names it)."""
    return f"{config.hydra.job.name}.log"


def _only_logs(directory: Path, log_name: str) -> bool:
    return all(p.name == log_name and p.is_file() for p in directory.iterdir())


def _remove(made: list[Path], log_name: str) -> None:
    """The log (its handler closed first), then each directory in ``made`` that is empty by then."""
    log = made[0] / log_name
    for handler in list(logging.root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == log.resolve():
            logging.root.removeHandler(handler)
            handler.close()
    log.unlink(missing_ok=True)
    for directory in made:
        try:
            directory.rmdir()
        except OSError:  # not empty: something else is there now (a parent another command also writes in)
            return
