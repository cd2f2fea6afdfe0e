"""bench_mlp with a timed step, for benchmarks/breakdown.py: where a dlaunch step's time goes.

    dlaunch recipe=bench_mlp recipe.entry=benchmarks/profiled_recipe.py ...   (BENCH_PHASES_DIR=DIR set)

The same model, data and update as ``recipes/bench_mlp.py``, but ``train_step``
takes the optimizer (dlaunch's manual mode: the same backward, step and
zero_grad dlaunch's simple mode runs) and times forward, backward (with DDP's
gradient all-reduce, which overlaps with it and is waited for at its end) and
the optimizer. The time from the end of one step to the start of the next is
what dlaunch's loop spends outside the recipe: fetching and splitting the next
batch, ``strategy.run``, the heartbeat, the stop-signal agreement, progress.
Each rank rewrites ``BENCH_PHASES_DIR/phases-RANK.json`` every 10 steps
(dlaunch's workers end with ``os._exit``: nothing runs at exit).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from launcher.recipes.bench_mlp import Config, build

__all__ = ["Config", "build", "train_step"]  # the recipe contract: Config and build as shipped, a timed train_step

_phases: list[list[float]] = []
_last_end: list[float] = []


def train_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], optimizer: torch.optim.Optimizer) -> torch.Tensor:
    t0 = time.perf_counter()
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    outside = t0 - _last_end[0] if _last_end else 0.0
    _last_end[:] = [t3]
    _phases.append([outside, t1 - t0, t2 - t1, t3 - t2])
    if len(_phases) % 10 == 0 and os.environ.get("BENCH_PHASES_DIR"):
        out = Path(os.environ["BENCH_PHASES_DIR"]) / f"phases-{os.environ.get('RANK', '0')}.json"
        out.write_text(json.dumps(_phases))
    return loss.detach()
