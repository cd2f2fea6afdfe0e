"""The best evaluation so far (``trainer.checkpoint.best``), and its checkpoint kept beside the newest ones.

At each evaluation rank 0 judges the metric against the best so far, and every rank follows its word (a save is
collective): a new best is saved at once, whether or not its step was due. Each checkpoint's manifest records the
best as of its step, so a resumed run judges against what the run it continues had seen, and a run resumed from an
earlier step against what was known then. ``CHECKPOINTS/best`` names the best checkpoint (``layout``), and
retention keeps it whatever its age.

    best = Best(spec.trainer.checkpoint.best, rank)
    if best.judge(step, metrics):          # collective: every rank gets rank 0's verdict
        checkpointer.save(...)             # its manifest carries best.record()
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch.distributed as dist

from launcher.checkpoint.errors import CheckpointError
from launcher.config.trainer import BestSpec

log = logging.getLogger("dlaunch")


class Best:
    """The best value of ``spec.metric`` so far, and the step it was evaluated at (None before the first)."""

    def __init__(self, spec: BestSpec, rank: int):
        self.metric, self.lower, self.rank = spec.metric, spec.lower, rank
        self.value: float | None = None
        self.step: int | None = None
        self._before: tuple[float | None, int | None] = (None, None)  # the best before the last new one

    @property
    def enabled(self) -> bool:
        return self.metric is not None

    def record(self) -> dict[str, Any]:
        """The manifest's ``best`` entry: the best as of the step saved ({} before any)."""
        if self.value is None:
            return {}
        return {"best": {"metric": self.metric, "mode": "min" if self.lower else "max", "value": self.value, "step": self.step}}

    def restore(self, saved: dict[str, Any]) -> None:
        """The best as of a resumed checkpoint (its manifest's); afresh where it judged another metric, or none."""
        found = saved.get("best")
        self.value = self.step = None
        if not self.enabled or not isinstance(found, dict):
            return
        mode = "min" if self.lower else "max"
        if (found.get("metric"), found.get("mode")) != (self.metric, mode):
            log.info("the checkpoint's best was %s (%s); %s (%s) is judged afresh from here",
                     found.get("metric"), found.get("mode"), self.metric, mode)
            return
        self.value, self.step = float(found["value"]), int(found["step"])

    def judge(self, step: int, metrics: dict[str, float]) -> bool:
        """Collective: whether ``step``'s evaluation is the best so far (rank 0's verdict, on every rank)."""
        if not self.enabled:
            return False
        verdict: Any = self._verdict(step, metrics) if self.rank == 0 else None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            shared = [verdict]
            dist.broadcast_object_list(shared, src=0)  # rank 0 evaluates (it alone, under some strategies)
            verdict = shared[0]
        if isinstance(verdict, str):
            raise CheckpointError(verdict)
        if verdict is None:
            return False
        self._before = (self.value, self.step)
        self.value, self.step = float(verdict), step
        return True

    def unsaved(self, step: int) -> None:
        """The save of ``step``, a new best, was refused (on_error=warn): the best is the best saved one, as before."""
        if self.step == step:
            self.value, self.step = self._before

    def _verdict(self, step: int, metrics: dict[str, float]) -> float | str | None:
        """The new best value, None where it is no better, or why it cannot be judged."""
        value = metrics.get(self.metric)
        if value is None:
            names = ", ".join(metrics) or "none: evaluate returned {}"
            return (f"trainer.checkpoint.best.metric={self.metric} is not among the metrics evaluate returned at step "
                    f"{step} ({names}); name one of them")
        if not math.isfinite(value):
            log.warning("%s is %s at step %d: not a best", self.metric, value, step)
            return None
        if self.value is not None and not (value < self.value if self.lower else value > self.value):
            return None
        return float(value)

    def said(self) -> str:
        """``eval_loss=0.0123 at step 40`` (empty before any)."""
        return "" if self.value is None else f"{self.metric}={self.value:.6g} at step {self.step}"

    def summary(self, root: Path) -> dict[str, Any] | None:
        """The run summary's ``best``: the metric, its value, the step and its checkpoint (None before any)."""
        if self.value is None:
            return None
        from launcher.checkpoint import layout

        return {"metric": self.metric, "value": self.value, "step": self.step,
                "checkpoint": str(layout.step_dir(root, self.step))}
