"""``script=train.py``: a user's unmodified torch script in place of a recipe.

    dlaunch script=train.py strategy=mirrored cluster=1x2 -- --epochs 3

Everything after ``--`` is the script's own ``sys.argv[1:]``. The script takes the
recipe's place in the plan (its name is the file's stem); the trainer and input
sections belong to dlaunch's loop, so their rules do not apply to a script.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from launcher.config.base import PlanError, PlanErrors, Strict
from launcher.config.errors import ConfigError, Problem, did_you_mean
from launcher.config.overrides import key_of
from launcher.config.trainer import TrainerSpec

SEPARATOR = "--"
ARGS: list[str] = []  # `dlaunch ... -- ARGS`: set once by the CLI, before anything is composed


class ScriptSpec(Strict):
    """``script``: the file to run as ``__main__`` in every worker process, and its arguments."""

    path: str = Field(min_length=1, description="the script to run (a .py file), relative to the current directory; "
                                                "given script.module, that module's file")
    module: str | None = Field(
        None, description="instead of path: a module run as `python -m` runs it (pkg.train; relative imports work), found "
                    "from the current directory")
    args: list[str] = Field(default_factory=list, description="its sys.argv[1:]: what follows `--` on the command line")

    @model_validator(mode="before")
    @classmethod
    def _from_path(cls, data: Any) -> Any:
        return {"path": data} if isinstance(data, str) else data

    @model_validator(mode="before")
    @classmethod
    def _module_found(cls, data: Any, info: ValidationInfo) -> Any:
        """``module`` gives ``path``: its file, found as ``python -m`` finds it (workers get both)."""
        if not isinstance(data, dict) or not data.get("module") or not isinstance(data["module"], str):
            return data  # without a module, a path is required
        module, given = data["module"], data.get("path")
        if not all(part.isidentifier() for part in module.split(".")):
            raise PlanError("script.module", module, "a module's dotted name (pkg.train), as python -m takes it; a "
                                                     "file is script=PATH")
        if given and not module_file_of(Path(str(given)), module):
            raise PlanError("script.module", module, f"and script.path={given}: give one of them (script.module runs "
                                                     "the module's file as python -m does)")
        return data if given else {**data, "path": str(find_module(module, (info.context or {}).get("cwd")))}

    @field_validator("path")
    @classmethod
    def _exists(cls, value: str, info: ValidationInfo) -> str:
        path = Path(value).expanduser().resolve()  # workers start elsewhere: they get the absolute path
        if (info.context or {}).get("check_files", True) is False:  # the validation's later rounds: looked at once
            return str(path)
        if path.is_dir():
            raise ValueError(f"{path} is a directory; name the script's .py file")
        if not path.is_file():
            near = did_you_mean(path.name, [p.name for p in path.parent.glob("*.py")]) if path.parent.is_dir() else None
            raise ValueError(f"no such file: {path}" + (f"; did you mean {near}?" if near else ""))
        _compiles(path)
        return str(path)

    @property
    def name(self) -> str:
        return self.module.rsplit(".", 1)[-1] if self.module else Path(self.path).stem

    @property
    def import_root(self) -> Path:
        """``sys.path[0]`` as python sets it: the script's directory, or where a module's top package is."""
        parts = len(self.module.split(".")) + (Path(self.path).name == "__main__.py") if self.module else 1
        return Path(self.path).parents[parts - 1]

    def command(self) -> str:
        """The script and its arguments as a shell would take them (``train.py --name 'my run'``, ``-m pkg.train``)."""
        return shlex.join([*(["-m", self.module] if self.module else [Path(self.path).name]), *self.args])


def find_module(module: str, cwd: str | None) -> Path:
    """The file ``python -m module`` runs, from ``cwd`` first, then ``sys.path`` (nothing imported: a package's
    ``__init__`` runs in the workers, as python runs it)."""
    import sys

    parts = module.split(".")
    roots = [Path(cwd or os.getcwd()), *(Path(p) for p in sys.path[1:] if p)]
    for root in roots:
        base = root.joinpath(*parts)
        for candidate in (base.with_name(base.name + ".py"), base / "__main__.py"):
            if candidate.is_file():
                return candidate.resolve()
        if base.is_dir() and root == roots[0]:
            raise PlanError("script.module", module, f"{base} is a package without __main__.py, which python -m cannot "
                                                     "run; name its training module (script.module=" f"{module}.train)")
    here = roots[0].joinpath(*parts[:-1])
    near = did_you_mean(parts[-1], [p.stem for p in here.glob("*.py")]) if here.is_dir() else None
    hint = f"; did you mean {'.'.join([*parts[:-1], near])}?" if near else ""
    raise PlanError("script.module", module, f"no module {module} under {roots[0]} (looked for "
                                             f"{'/'.join(parts)}.py and {'/'.join(parts)}/__main__.py) or on sys.path{hint}")


def module_file_of(path: Path, module: str) -> bool:
    """Whether ``path`` is the file of ``module`` (``.../pkg/train.py`` or ``.../pkg/train/__main__.py``)."""
    parts = module.split(".")
    tail = [*parts[:-1], parts[-1] + ".py"] if path.name != "__main__.py" else [*parts, "__main__.py"]
    return list(path.parts[-len(tail):]) == tail


def _compiles(path: Path) -> None:
    """A syntax error is found here, before any worker starts, and said in one line as a recipe's is (python's
    own compile: the script is not run, nothing is imported)."""
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        at = f":{exc.lineno}" if exc.lineno else ""  # a binary file: no line
        raise ValueError(f"{exc.filename or path}{at}: {type(exc).__name__}: {exc.msg} (is it a Python script?)") from None
    except ValueError as exc:  # null bytes in the source
        raise ValueError(f"{path}: {exc}") from None


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``dlaunch OVERRIDES -- SCRIPT_ARGS``: the overrides, and the script's arguments."""
    if SEPARATOR not in argv:
        return argv, []
    cut = argv.index(SEPARATOR)
    return argv[:cut], argv[cut + 1:]


_SECTIONS = ("strategy", "cluster", "recipe", "trainer", "input", "launch", "sweep", "script", "hydra")


def like_settings(args: list[str]) -> list[str]:
    """A script's arguments that read as dlaunch's settings (``strategy=mirrored``, ``trainer.steps=5``): typed after
    ``--`` by mistake, they go to the script, and dlaunch runs without them."""
    return [a for a in args if "=" in a and key_of(a).split(".")[0] in _SECTIONS]


def path_beside_keys(overrides: list[str]) -> list[str]:
    """``script=PATH`` beside a ``script.KEY=`` override (``script.args=[...]``, a sweep over a script's arguments)
    as ``script.path=PATH``: Hydra would let the later of the two replace the other whole."""
    if not any(key_of(o).startswith("script.") for o in overrides):
        return overrides
    return [f"script.path={o.split('=', 1)[1]}" if "=" in o and key_of(o) == "script" and not o.startswith("~") else o
            for o in overrides]


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
    path, module = str(script.get("path") or ""), str(script.get("module") or "")
    data["recipe"] = {"name": module.rsplit(".", 1)[-1] or Path(path).stem or "script", "entry": path or module or "script"}


# What a script does instead of each trainer key it does not honour: dlaunch's loop does these, and a script runs its own.
# trainer.seed is honoured (the RNGs are seeded with it on every rank), and trainer.precision through the strategy's
# autocast() and grad_scaler(); trainer.resume=auto or never means nothing to a script (it starts from its beginning),
# so only a checkpoint PATH is refused.
INSTEAD = {
    "steps": "the script runs as long as its own loop does: pass its length after -- (e.g. -- --steps N)",
    "log_every": "dlaunch's loop writes metrics.jsonl; a script writes its own to $DLAUNCH_RUN_DIR (docs/SCRIPTS.md)",
    "checkpoint": "a script saves its own checkpoints (launcher.checkpoint.scripts.ScriptCheckpoints, or torch.save): "
                  "dlaunch's loop cannot know its state",
    "pretrained": "load the weights in your script (torch.load(PATH, weights_only=True), or "
                 "launcher.checkpoint.read_tensors for a dlaunch checkpoint)",
    "resume": "a script resumes from its own checkpoints: load one in the script (ScriptCheckpoints.restore)",
    "loggers": "log from the script (e.g. torch.utils.tensorboard's SummaryWriter on rank 0)",
    "compile": "torch.compile the model in your script",
    "grad_accum_steps": "accumulate in your script: backward under `with strategy.no_sync(model):` on all but the "
                        "last of N micro-batches, then step (docs/SCRIPTS.md)",
    "clip_grad_norm": "clip in your script: `strategy.clip_grad_norm_(model, optimizer, max_norm)` after backward "
                      "(docs/SCRIPTS.md)",
    "lr_schedule": "use a torch.optim.lr_scheduler in your script",
    "eval_every": "evaluate in your script",
    "profile": "trainer.profile profiles dlaunch's training loop; profile the script's own loop with torch.profiler "
               "(docs/TRAINING.md, trainer.profile, shows what dlaunch records)",
}


def script_fits(spec: Any, cuda: int) -> None:
    """A strategy that builds the model in ps tasks needs a recipe's ``build``: a script cannot give it one.
    Every ``trainer`` key a script does not honour, set to other than its default, is refused with what to do instead,
    and fp16-mixed or activation checkpointing where the strategy refuses it for its loop (the script's GradScaler
    or ``strategy.prepare()`` would meet the same)."""
    if spec.script is None:
        return
    errors = [PlanError(f"trainer.{key}", value, f"a script runs its own loop, so dlaunch does not apply this; "
                                                 f"{INSTEAD[key.split('.')[0]]}")
              for key, value in _set_for_a_script(spec.trainer)]
    for feature, key, value in (("fp16-mixed", "trainer.precision", spec.trainer.precision == "fp16-mixed" and "fp16-mixed"),
                                ("activation_checkpointing", "trainer.activation_checkpointing",
                                 spec.trainer.activation_checkpointing)):
        refused = value and spec.strategy.refusal(feature, spec)  # the script's grad_scaler() or prepare() meets it too
        if refused:
            errors.append(PlanError(key, value, f"strategy {spec.strategy.name} cannot do this: {refused}"))
    if not spec.strategy.runs_scripts:
        errors.append(PlanError("strategy", spec.strategy.name,
                                f"strategy {spec.strategy.name} builds the model on its ps tasks from a recipe's build(); "
                                "a script runs only in the training processes; use a recipe, or strategy=multi_worker_mirrored"))
    if len(errors) > 1:
        raise PlanErrors(errors)
    if errors:
        raise errors[0]


def _set_for_a_script(trainer: TrainerSpec) -> list[tuple[str, Any]]:
    """The trainer's keys (dotted, under ``trainer``) set to other than their defaults, that a script does not honour."""
    def leaves(value: Any, default: Any, key: str) -> list[tuple[str, Any]]:
        if isinstance(value, dict):
            return [leaf for k in value for leaf in leaves(value[k], default[k], f"{key}.{k}")]
        return [] if value == default else [(key, value)]

    given, defaults = trainer.model_dump(), TrainerSpec().model_dump()
    if given["resume"] in ("auto", "never"):
        given["resume"] = defaults["resume"]
    return [leaf for k in INSTEAD for leaf in leaves(given[k], defaults[k], k)]
