"""The recipe's ``evaluate``, as the loop calls it: the user's module in eval mode, holding its values.

``evaluate(model, parts)`` gets the user's own module (DDP's and mirrored copies' wrappers
unwrapped), with its parameters on the device the model computes on, so that
``next(model.parameters()).device`` is where its data goes. A parameter-server chief's
module is shapes on meta while it trains (the values live on the ps tasks): for the
evaluation it holds their values, pulled (``PSModule.materialized``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from launcher.checkpoint.state import unwrap
from launcher.runtime import recipe as recipe_lib


class Evaluator:
    """The recipe's ``evaluate`` under the run's precision, with the model in eval mode; {} without one."""

    def __init__(self, evaluate: Any, model: Any, parts: Any, step: Any, chief: bool, everywhere: bool):
        self.evaluate, self.model, self.parts, self.step = evaluate, model, parts, step
        self.here = evaluate is not None and (chief or everywhere)  # a split model's forward needs every rank
        self.chief_alone = evaluate is not None and not everywhere  # the other ranks wait for rank 0's

    def __call__(self) -> dict[str, float]:
        if not self.here:
            return {}
        with evaluated(self.model) as module:
            was_training = module.training
            module.eval()
            try:
                # one region over the whole evaluation: torch's cache of each weight's cast would outlive a weight
                # the recipe changes in place (an EMA swapped in), and evaluate the old one
                with torch.no_grad(), self.step.autocast(cache=False), _training_rng_kept():
                    found = self.evaluate(module, self.parts)
            finally:
                module.train(was_training)
        return recipe_lib.checked_metrics(found, self.evaluate)


@contextlib.contextmanager
def _training_rng_kept() -> Iterator[None]:
    """The random generators (torch's, CUDA's, numpy's, Python's) as they were before the evaluation: what it draws
    (a DataLoader's seed, a random subset) leaves training as it would be without it, whatever ``eval_every``."""
    from launcher.checkpoint.state import rng_state, set_rng_state

    before = rng_state()
    try:
        yield
    finally:
        set_rng_state(before)


@contextlib.contextmanager
def evaluated(model: Any) -> Iterator[torch.nn.Module]:
    """The user's module of ``model``, holding its values for the evaluation (variables held elsewhere: pulled)."""
    materialized = getattr(model, "materialized", None)  # a parameter-server task's module: values on the ps tasks
    if materialized is None:
        yield unwrap(model)
        return
    with materialized() as module:
        yield module


def said(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.6g}" for k, v in metrics.items())
