"""``script=train.py``: a user's unmodified torch script in place of a recipe.

    dlaunch script=train.py strategy=mirrored cluster=1x2 -- --epochs 3

Everything after ``--`` is the script's own ``sys.argv[1:]``. The script takes the
recipe's place in the plan (its name is the file's stem); the trainer and input
sections belong to dlaunch's loop, so their rules do not apply to a script.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from launcher.config.base import PlanError, Strict
from launcher.config.errors import ConfigError, Problem

SEPARATOR = "--"
ARGS: list[str] = []  # `dlaunch ... -- ARGS`: set once by the CLI, before anything is composed


class ScriptSpec(Strict):
    """``script``: the file to run as ``__main__`` in every worker process, and its arguments."""

    path: str = Field(min_length=1, description="the script to run (a .py file), relative to the current directory")
    args: list[str] = Field(default_factory=list, description="its sys.argv[1:]: what follows `--` on the command line")

    @model_validator(mode="before")
    @classmethod
    def _from_path(cls, data: Any) -> Any:
        return {"path": data} if isinstance(data, str) else data

    @field_validator("path")
    @classmethod
    def _exists(cls, value: str) -> str:
        path = Path(value).expanduser().resolve()  # workers start elsewhere: they get the absolute path
        if path.is_dir():
            raise ValueError(f"{path} is a directory; name the script's .py file")
        if not path.is_file():
            raise ValueError(f"no such file: {path}")
        return str(path)

    @property
    def name(self) -> str:
        return Path(self.path).stem

    def command(self) -> str:
        return " ".join([Path(self.path).name, *self.args])


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``dlaunch OVERRIDES -- SCRIPT_ARGS``: the overrides, and the script's arguments."""
    if SEPARATOR not in argv:
        return argv, []
    cut = argv.index(SEPARATOR)
    return argv[:cut], argv[cut + 1:]


def apply(data: dict[str, Any]) -> None:
    """Fill in the script's arguments, and let the script stand in the recipe's place (composed data, before validation)."""
    script = data.get("script")
    if script is None:
        if ARGS:
            raise ConfigError([Problem(key=SEPARATOR, value=" ".join(ARGS), message="arguments after -- go to a script, "
                                       "but no script was given; add script=PATH (e.g. script=train.py)")])
        return
    if isinstance(script, str):
        script = {"path": script}
    given = script.get("args") or []
    if isinstance(given, list):  # `script.args=[--epochs,3]`: Hydra reads 3 as a number, and sys.argv holds strings
        given = [str(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a for a in given]
    data["script"] = {**script, "args": [*given, *ARGS] if isinstance(given, list) else given}
    path = str(script.get("path") or "")
    data["recipe"] = {"name": Path(path).stem or "script", "entry": path or "script"}


def script_fits(spec: Any, cuda: int) -> None:
    """A strategy that builds the model in ps tasks needs a recipe's ``build``: a script cannot give it one.
    ``trainer.profile`` profiles dlaunch's loop, which a script does not run."""
    if spec.script is not None and spec.trainer.profile.enabled:
        raise PlanError("trainer.profile.enabled", True,
                        "trainer.profile profiles dlaunch's training loop, and a script runs its own; profile it there "
                        "with torch.profiler (docs/TRAINING.md, trainer.profile, shows what dlaunch records)")
    if spec.script is not None and not spec.strategy.runs_scripts:
        raise PlanError("strategy", spec.strategy.name,
                        f"strategy {spec.strategy.name} builds the model on its ps tasks from a recipe's build(); "
                        "a script runs only in the training processes; use a recipe, or strategy=multi_worker_mirrored")
