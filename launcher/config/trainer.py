"""``trainer``: the loop's length, seed and logging, checkpoints and resume."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from launcher.config.base import PlanError, PositiveInt, Strict


class CheckpointSpec(Strict):
    """``trainer.checkpoint``: periodic DCP checkpoints (and one on SIGTERM/SIGINT/SIGHUP)."""

    every_steps: Annotated[int, Field(ge=0)] = Field(0, description="save every N steps and at the end; 0: off")
    keep: PositiveInt = Field(3, description="how many of the newest checkpoints to keep")
    dir: str | None = Field(None, min_length=1, description="default: RUN_DIR/checkpoints")
    on_error: Literal["error", "warn"] = Field(
        "error", description="a save the storage refuses (disk full, I/O error): error ends the run; warn logs it and trains on")

    @field_validator("dir", mode="after")
    @classmethod
    def _absolute(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _absolute_path(value, info)

    def root(self, run_dir: Path) -> Path:
        """Where the run's checkpoints live: ``dir``, else ``RUN_DIR/checkpoints``."""
        return Path(self.dir) if self.dir else run_dir / "checkpoints"


class TrainerSpec(Strict):
    steps: PositiveInt = 100
    seed: Annotated[int, Field(ge=0)] = 0
    log_every: PositiveInt = 10
    checkpoint: CheckpointSpec = CheckpointSpec()
    resume: str = Field(
        "auto", min_length=1,
        description="auto: the newest complete checkpoint of the run, if any; never; or a checkpoint PATH",
    )
    loggers: list[Literal["tensorboard"]] = Field(default_factory=list, description="also log to these (tensorboard: RUN_DIR/tensorboard)")

    @field_validator("loggers", mode="after")
    @classmethod
    def _installed(cls, value: list[str]) -> list[str]:
        from launcher.runtime.loggers import tensorboard_available

        if "tensorboard" in value and not tensorboard_available():
            raise PlanError("trainer.loggers", value, "the tensorboard logger needs the tensorboard package: pip install tensorboard")
        return value

    @field_validator("resume", mode="after")
    @classmethod
    def _resume_path(cls, value: str, info: ValidationInfo) -> str:
        if value in ("auto", "never"):
            return value
        path = _absolute_path(value, info)
        if not os.path.exists(path):
            raise PlanError("trainer.resume", value, f"no checkpoint at {path}; allowed: auto, never, or the path of a checkpoint")
        return path


def _absolute_path(value: str, info: ValidationInfo) -> str:
    """Relative paths are taken from the directory dlaunch starts in (workers get the absolute one)."""
    base = (info.context or {}).get("cwd") or os.getcwd()
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))
