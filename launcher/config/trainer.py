"""``trainer``: the loop's length, seed and logging, checkpoints and resume, and how each step trains:
precision, ``torch.compile``, gradient accumulation and clipping, the learning-rate schedule, evaluation."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from launcher.config import disk
from launcher.config.base import PlanError, PlanErrors, PositiveInt, Strict, check_rules
from launcher.config.metric_names import lower_by_name

if TYPE_CHECKING:
    from launcher.config.schema import RunSpec


class BestSpec(Strict):
    """``trainer.checkpoint.best``: also keep the checkpoint of the best evaluation so far (a save at each new best)."""

    metric: str | None = Field(None, min_length=1, description="a metric the recipe's evaluate returns (eval_loss, "
                                                                 "accuracy); null: keep the newest checkpoints only")
    mode: Literal["auto", "min", "max"] = Field(
        "auto", description="min: lower is better; max: higher; auto: from the metric's name (loss, error, perplexity: "
                            "min; accuracy, f1, auc, score: max)")

    @property
    def lower(self) -> bool | None:
        """Whether a lower value is better (None: ``auto`` and the name says neither)."""
        return self.mode == "min" if self.mode != "auto" else (lower_by_name(self.metric) if self.metric else None)

    def said(self) -> str:
        return f"the {'lowest' if self.lower else 'highest'} {self.metric}"


class CheckpointSpec(Strict):
    """``trainer.checkpoint``: periodic DCP checkpoints (and one on SIGTERM/SIGINT/SIGHUP)."""

    every_steps: Annotated[int, Field(ge=0)] = Field(0, description="save every N steps and at the end; 0: off")
    keep: PositiveInt = Field(3, description="how many of the newest checkpoints to keep")
    dir: str | None = Field(None, min_length=1, description="default: RUN_DIR/checkpoints")
    on_error: Literal["error", "warn"] = Field(
        "error", description="a save the storage refuses (disk full, I/O error): error ends the run; warn logs it and trains on")
    best: BestSpec = BestSpec()

    @field_validator("dir", mode="after")
    @classmethod
    def _absolute(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _absolute_path(value, info)

    @model_validator(mode="after")
    def _dir_usable(self, info: ValidationInfo) -> "CheckpointSpec":
        """The parent asks the disk (``check_files``), beside every other problem: not after them, in the job."""
        why = self.dir and self.every_steps and (info.context or {}).get("check_files") and disk.unusable_dir(self.dir)
        if why:
            raise PlanError("trainer.checkpoint.dir", self.dir, why)
        return self

    def root(self, run_dir: Path) -> Path:
        """Where the run's checkpoints live: ``dir``, else ``RUN_DIR/checkpoints``."""
        return Path(self.dir) if self.dir else run_dir / "checkpoints"


class ScheduleSpec(Strict):
    """``trainer.lr_schedule``: the learning rate over the run, as a factor of the optimizer's ``lr``.

    Linear warm-up from ``warmup_start`` x lr to lr over ``warmup_steps``, then ``decay``
    (cosine or linear) to ``min_lr_ratio`` x lr over ``decay_steps``, then constant.
    """

    decay: Literal["constant", "cosine", "linear"] = Field("constant", description="constant | cosine | linear, after the warm-up")
    warmup_steps: Annotated[int, Field(ge=0)] = Field(0, description="linear warm-up steps (0: none)")
    warmup_start: Annotated[float, Field(ge=0, le=1)] = Field(
        0.0, description="the factor of lr the warm-up rises from: step i of N uses start + (1 - start) x (i + 1) / N")
    decay_steps: PositiveInt | None = Field(None, description="steps of decay after the warm-up; null: the rest of trainer.steps")
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = Field(0.0, description="where the decay ends, as a factor of lr")

    @property
    def constant(self) -> bool:
        return self.decay == "constant" and self.warmup_steps == 0

    def decay_length(self, total_steps: int) -> int:
        """The decay's steps in a run of ``total_steps``: ``decay_steps``, else the rest after the warm-up."""
        return self.decay_steps or max(total_steps - self.warmup_steps, 1)


class CompileSpec(Strict):
    """``trainer.compile``: ``torch.compile`` the model, after the strategy has wrapped it."""

    enabled: bool = Field(False, description="compile the model's forward (and backward) with torch.compile")
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile's mode: reduce-overhead uses CUDA graphs, max-autotune also tunes kernels")
    fullgraph: bool = Field(False, description="fail on any graph break instead of falling back to eager for that part")
    dynamic: bool | None = Field(None, description="null: torch decides; false: one graph per shape")


class PretrainedSpec(Strict):
    """``trainer.pretrained``: the model's weights before step 0, from a checkpoint or a file (a fine-tune's start)."""

    path: str | None = Field(
        None, min_length=1,
        description="a dlaunch checkpoint (step-N, a directory of them, a run directory), a DCP directory, a "
                    "torch.save'd state dict or a .safetensors file; the optimizer and the step start afresh")
    strict: bool = Field(True, description="the names and shapes must match the model's; false: load those that do, "
                                           "the rest keep build()'s values (a new head)")

    @field_validator("path", mode="after")
    @classmethod
    def _exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        path = _absolute_path(value, info)
        if (info.context or {}).get("check_files") and not os.path.exists(path):
            raise PlanError("trainer.pretrained.path", value, f"no such file or directory: {path}")
        return path

    def rows(self, resume_from: Path | None) -> list[tuple[str, str]]:
        """The plan's row: where the weights come from, or why they are not loaded."""
        if self.path is None:
            return []
        if resume_from is not None:
            return [("pretrained", f"not used: the run resumes from {resume_from.name}, its own weights")]
        kept = "names and shapes must match" if self.strict else "tensors that match; the rest as build() made them"
        return [("pretrained", f"{self.path}: its model weights before step 0 ({kept}); a fresh optimizer")]


class ProfileSpec(Strict):
    """``trainer.profile``: ``torch.profiler`` over a few steps; a trace and an op table per rank in RUN_DIR/profile."""

    enabled: bool = Field(False, description="profile a window of steps (CPU, and CUDA where the run is on a GPU)")
    wait: Annotated[int, Field(ge=0)] = Field(10, description="steps of this command to run before the window (compile, warm-up)")
    warmup: Annotated[int, Field(ge=0)] = Field(2, description="steps profiled and thrown away, before the recorded ones")
    active: PositiveInt = Field(3, description="steps recorded")
    record_shapes: bool = Field(False, description="record each op's input shapes")
    memory: bool = Field(False, description="record tensor allocations (torch.profiler's profile_memory)")
    with_stack: bool = Field(False, description="record the Python stack of each op (larger traces)")

    @property
    def window(self) -> int:
        return self.wait + self.warmup + self.active


class TrainerSpec(Strict):
    """``trainer``: the training loop: how long, from which seed, how each step trains, checkpoints and resume."""

    steps: PositiveInt = Field(100, description="optimizer steps to train (a resumed run trains up to this step)")
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = Field(0, description="seeds torch, numpy and random in every process, and the shuffle (numpy's range: 0 to 2**32 - 1)")
    log_every: PositiveInt = Field(10, description="write a metrics.jsonl record (loss, examples/s, lr) every N steps")
    checkpoint: CheckpointSpec = CheckpointSpec()
    pretrained: PretrainedSpec = PretrainedSpec()
    resume: str = Field(
        "auto", min_length=1,
        description="auto: the newest complete checkpoint of the run, if any; never; or a checkpoint PATH",
    )
    loggers: list[Literal["tensorboard"]] = Field(default_factory=list, description="also log to these (tensorboard: RUN_DIR/tensorboard)")
    precision: Literal["fp32", "bf16-mixed", "fp16-mixed"] = Field(
        "fp32", description="fp32 | bf16-mixed (bf16 autocast, fp32 weights) | fp16-mixed (fp16 autocast + GradScaler)",
    )
    compile: CompileSpec = CompileSpec()
    activation_checkpointing: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="module class names (a transformer's block) whose forward is recomputed in backward instead of "
                    "keeping its activations: less memory, about one more forward of compute")
    grad_accum_steps: PositiveInt = Field(1, description="micro-batches per replica per step; gradients sync once per step")
    clip_grad_norm: Annotated[float, Field(gt=0)] | None = Field(None, description="clip the averaged gradients' total norm to this")
    lr_schedule: ScheduleSpec = ScheduleSpec()
    eval_every: Annotated[int, Field(ge=0)] = Field(0, description="evaluate every N steps (the recipe's evaluate); 0: at the end only")
    profile: ProfileSpec = ProfileSpec()

    @model_validator(mode="after")
    def _fits_in_steps(self) -> "TrainerSpec":
        check_rules((_schedule_fits, _schedule_settings_used, _profile_fits, _pretrained_used), self)
        return self

    @field_validator("activation_checkpointing", mode="after")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) < len(value):
            raise PlanError("trainer.activation_checkpointing", value, "names a module class twice; name each once")
        return value

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
        # The parent checks the disk (check_files); workers trust it. A worker restarted later resumes from the
        # run's newest checkpoint, and retention may have removed this one by then (checkpoint.select).
        if (info.context or {}).get("check_files") and not os.path.exists(path):
            raise PlanError("trainer.resume", value, f"no checkpoint at {path}; allowed: auto, never, or the path of a checkpoint")
        return path


def _absolute_path(value: str, info: ValidationInfo) -> str:
    """Relative paths are taken from the directory dlaunch starts in (workers get the absolute one)."""
    base = (info.context or {}).get("cwd") or os.getcwd()
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


# ---------- cross-field rules (RunSpec calls them with the whole spec) ----------

def accumulation_divides(spec: "RunSpec", cuda: int) -> None:
    k, n, gbs = spec.trainer.grad_accum_steps, spec.num_replicas, spec.input.global_batch_size
    if k > 1 and gbs % n == 0 and spec.per_replica_batch_size % k:  # an uneven split is batch_divides' to name
        per = spec.per_replica_batch_size
        raise PlanError(
            "trainer.grad_accum_steps", k,
            f"global batch {gbs} = {n} replica(s) x {per} per replica, and {per} does not split into {k} equal "
            f"micro-batches; use a grad_accum_steps that divides {per}, or input.global_batch_size={n * k * max(1, per // k)} "
            f"(= micro-batch {max(1, per // k)} x {n} replica(s) x {k} steps)",
        )


def best_is_evaluated(spec: "RunSpec", cuda: int) -> None:
    """``trainer.checkpoint.best`` keeps a checkpoint saved at an evaluation: it needs both, and a known direction."""
    t = spec.trainer
    best = t.checkpoint.best
    if best.metric is None:
        return
    errors = []
    if not t.checkpoint.every_steps:
        errors.append(PlanError("trainer.checkpoint.every_steps", 0, f"trainer.checkpoint.best.metric={best.metric} keeps "
                                "the best checkpoint beside the newest ones: turn checkpoints on (every_steps=N)"))
    if not t.eval_every:
        errors.append(PlanError("trainer.eval_every", 0, f"trainer.checkpoint.best.metric={best.metric} is judged at each "
                                "evaluation, and 0 evaluates only at the end (whose checkpoint is the newest anyway); set "
                                "trainer.eval_every=N"))
    if best.lower is None:
        errors.append(PlanError("trainer.checkpoint.best.mode", "auto", f"the name {best.metric!r} does not say whether "
                                "lower or higher is better; allowed: min, max"))
    if len(errors) > 1:
        raise PlanErrors(errors)
    if errors:
        raise errors[0]


def strategy_trains_so(spec: "RunSpec", cuda: int) -> None:
    """A strategy names the trainer features it cannot honour, and why (``refuses``)."""
    t = spec.trainer
    # the schedule's key the user set: decay where it decays, else the warm-up that makes it not constant
    schedule_key, schedule_value = (("trainer.lr_schedule.decay", t.lr_schedule.decay) if t.lr_schedule.decay != "constant"
                                    else ("trainer.lr_schedule.warmup_steps", t.lr_schedule.warmup_steps))
    used = {
        "fp16-mixed": ("trainer.precision", t.precision == "fp16-mixed", t.precision),
        "compile": ("trainer.compile.enabled", t.compile.enabled, True),
        "activation_checkpointing": ("trainer.activation_checkpointing", bool(t.activation_checkpointing),
                                     t.activation_checkpointing),
        "lr_schedule": (schedule_key, not t.lr_schedule.constant, schedule_value),
        "clip_grad_norm": ("trainer.clip_grad_norm", t.clip_grad_norm is not None, t.clip_grad_norm),
        "pretrained": ("trainer.pretrained.path", t.pretrained.path is not None, t.pretrained.path),
    }
    errors = [PlanError(key, value, f"strategy {spec.strategy.name} cannot do this: {why}")
              for feature, (key, on, value) in used.items() if on and (why := spec.strategy.refusal(feature, spec))]
    if len(errors) > 1:
        raise PlanErrors(errors)  # every feature it refuses, in one screen
    if errors:
        raise errors[0]


def precision_runs_here(spec: "RunSpec", cuda: int) -> None:
    """bf16 needs a GPU that computes in it (Ampere or later); the CPU always can."""
    if spec.trainer.precision != "bf16-mixed" or spec.device_type(cuda) != "cuda" or cuda <= 0:
        return
    from launcher.cluster import gpus

    # Not torch.cuda.is_bf16_supported(): by default it says True where bf16 is only emulated (a V100, a T4), slowly.
    # The driver says, from a child process: the parent never initialises CUDA.
    c = spec.cluster  # the GPUs this job uses: those the strategy names, else each node's (every emulated node's here)
    found = gpus.devices()
    named = [int(d.split(":")[1]) for _, d in spec.strategy.named_devices() if d.startswith("cuda:")]
    used = [found[i] for i in named if i < len(found)] if named else found[:c.world_size if c.emulated else c.devices_per_node]
    older = [d for d in used if d.capability < (8, 0)]
    if older:
        raise PlanError("trainer.precision", "bf16-mixed",
                        f"{older[0].name} (compute capability {older[0].major}.{older[0].minor}) does not compute in "
                        "bf16 (it needs 8.0 or later: torch would only emulate it, slowly); use trainer.precision=fp16-mixed or fp32")


def _schedule_fits(t: TrainerSpec) -> None:
    s = t.lr_schedule
    if s.warmup_steps > t.steps:
        raise PlanError("trainer.lr_schedule.warmup_steps", s.warmup_steps,
                        f"warm-up of {s.warmup_steps} steps is longer than trainer.steps={t.steps}")
    if s.decay != "constant" and s.warmup_steps == t.steps:  # a setting that would change nothing
        raise PlanError("trainer.lr_schedule.warmup_steps", s.warmup_steps,
                        f"warm-up of {s.warmup_steps} steps = trainer.steps={t.steps} leaves no step for "
                        f"decay={s.decay}; use at most {t.steps - 1} warm-up steps, or decay=constant")
    if s.decay_steps is not None and s.warmup_steps + s.decay_steps > t.steps:
        raise PlanError("trainer.lr_schedule.decay_steps", s.decay_steps,
                        f"warmup_steps {s.warmup_steps} + decay_steps {s.decay_steps} = {s.warmup_steps + s.decay_steps} "
                        f"is longer than trainer.steps={t.steps}; use at most {t.steps - s.warmup_steps} or null")


def _schedule_settings_used(t: TrainerSpec) -> None:
    """A schedule setting that would change nothing is said, not ignored: each one."""
    s = t.lr_schedule
    errors = []
    for key, value, unused in (("decay_steps", s.decay_steps, s.decay_steps is not None and s.decay == "constant"),
                               ("min_lr_ratio", s.min_lr_ratio, s.min_lr_ratio > 0 and s.decay == "constant"),
                               ("warmup_start", s.warmup_start, s.warmup_start > 0 and s.warmup_steps == 0)):
        if unused:
            needs = "warmup_steps > 0" if key == "warmup_start" else "decay=cosine or decay=linear"
            errors.append(PlanError(f"trainer.lr_schedule.{key}", value, f"{key} needs {needs}"))
    if errors:
        raise PlanErrors(errors)


def _pretrained_used(t: TrainerSpec) -> None:
    """A resume from a named checkpoint brings its own weights: pretrained would change nothing."""
    if t.pretrained.path is not None and t.resume not in ("auto", "never"):
        raise PlanError("trainer.pretrained.path", t.pretrained.path,
                        f"trainer.resume={t.resume} resumes with that checkpoint's weights, so these would never be "
                        "loaded; keep one: trainer.resume=PATH goes on with a run, trainer.pretrained starts one from its weights")


def _profile_fits(t: TrainerSpec) -> None:
    p = t.profile
    if p.enabled and p.window > t.steps:
        key, value = ("trainer.profile.wait", p.wait) if p.warmup + p.active <= t.steps else ("trainer.profile.active", p.active)
        raise PlanError(key, value,
                        f"the profile window (wait {p.wait} + warmup {p.warmup} + active {p.active} = {p.window} steps) is "
                        f"longer than trainer.steps={t.steps}; lower {key} or raise trainer.steps")
