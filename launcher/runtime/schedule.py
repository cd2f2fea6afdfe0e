"""The learning-rate schedule: a constant lr, or a linear warm-up then a cosine or linear decay to a floor, as torch's
``LambdaLR`` over the primary optimizer (``trainer.lr_schedule``); and the lr a step used, for the records."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from launcher.checkpoint.state import primary
from launcher.config.trainer import ScheduleSpec, TrainerSpec


class ScheduleFactor:
    """The factor of the optimizer's lr after ``step`` optimizer steps (picklable, for LambdaLR's state)."""

    def __init__(self, spec: ScheduleSpec, total_steps: int):
        self.decay, self.warmup, self.start = spec.decay, spec.warmup_steps, spec.warmup_start
        self.decay_steps = spec.decay_length(total_steps)
        self.floor = spec.min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:  # the warm-up's last step reaches the full lr; its first is not wasted at 0
            return self.start + (1.0 - self.start) * (step + 1) / self.warmup
        if self.decay == "constant":
            return 1.0
        t = min(step - self.warmup, self.decay_steps) / self.decay_steps
        if self.decay == "cosine":
            return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * t))
        return 1.0 - (1.0 - self.floor) * t


def make_schedule(trainer: TrainerSpec, optimizer: Any) -> torch.optim.lr_scheduler.LRScheduler | None:
    """torch's ``LambdaLR`` over the primary optimizer (mirrored copies take its lr at each step); None when constant."""
    if trainer.lr_schedule.constant:
        return None
    if trainer.precision == "fp16-mixed":  # GradScaler skips early updates; the schedule counts steps all the same
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
    return torch.optim.lr_scheduler.LambdaLR(primary(optimizer), ScheduleFactor(trainer.lr_schedule, trainer.steps))


def current_lr(optimizer: Any) -> dict[str, float]:
    """``{"lr": ...}``, the first parameter group's; where the groups train at rates of their own (a fine-tune's head),
    each other group's too: ``lr_group1``, ... (an optimizer with none, a parameter server's chief: ``{}``)."""
    groups = getattr(primary(optimizer), "param_groups", None) or []
    own = len({float(g.get("initial_lr", g["lr"])) for g in groups}) > 1  # a schedule keeps each group's base rate
    return {("lr" if i == 0 else f"lr_group{i}"): float(g["lr"]) for i, g in enumerate(groups) if i == 0 or own}
