"""Baseline: a hand-written single-GPU training loop for the scaled charlm workload (gpu.py).

    python benchmarks/gpu_loop.py --precision bf16 --compile --steps 150 --out hand.json

What a careful user writes by hand: the recipe's model and data, AdamW, a DataLoader
with pinned memory and ``non_blocking`` copies, optional bf16 autocast and
``torch.compile``. Losses are read (``.item()``) only at the steps dlaunch logs,
and step times are taken the same way as dlaunch's ``steady_ms_per_step``
(median wall time per step from step 20 on), so the two are measured alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipes import charlm  # noqa: E402  (the repository's recipe: the same model and data as dlaunch's)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = charlm.CharTransformer(args.context, args.d_model, args.heads, args.layers, 0.0).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)
    cfg = charlm.Config(name="charlm", entry="charlm", context=args.context, d_model=args.d_model, heads=args.heads, layers=args.layers)
    train, _ = charlm.make_data(cfg)
    loader = DataLoader(train, batch_size=args.batch, shuffle=True, drop_last=True, pin_memory=True,
                        generator=torch.Generator().manual_seed(0))
    forward = torch.compile(model) if args.compile else model
    dtype = torch.bfloat16 if args.precision == "bf16" else None

    batches = iter(loader)
    step_seconds, losses = [], {}
    for step in range(1, args.steps + 1):
        tick = time.perf_counter()
        inputs, targets = (t.cuda(non_blocking=True) for t in next(batches))
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            logits = forward(inputs)
            loss = nn.functional.cross_entropy(logits.reshape(-1, charlm.VOCAB), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            losses[step] = loss.item()
        step_seconds.append(time.perf_counter() - tick)
    Path(args.out).write_text(json.dumps({
        "steady_ms_per_step": statistics.median(step_seconds[19:]) * 1000,
        "losses": losses,
        "params": sum(p.numel() for p in model.parameters()),
    }))


if __name__ == "__main__":
    main()
