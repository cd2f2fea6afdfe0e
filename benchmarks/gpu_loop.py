"""Baseline: a hand-written single-GPU training loop for the scaled charlm workload (gpu.py).

    python benchmarks/gpu_loop.py --precision bf16 --compile --steps 150 --out hand.json

What a careful user writes by hand: the recipe's model and data, AdamW (fused on CUDA), a DataLoader
with pinned memory and ``non_blocking`` copies, optional bf16 autocast and
``torch.compile`` (``--compile-mode reduce-overhead``: with CUDA graphs).
Losses are read (``.item()``) only at the steps dlaunch logs,
and step times are taken the same way as dlaunch's ``steady_ms_per_step``
(median wall time per step from step 20 on), so the two are measured alike.

``--profile DIR`` runs ``torch.profiler`` over steps 33-37 the way ``trainer.profile`` does
(``DIR/profile/hand.trace.json`` and ``hand-ops.txt``), with the same region names as dlaunch's
(``dlaunch.data``, ``dlaunch.step``), so the two op tables compare line for line.
``--device cpu`` runs it on the CPU (the test of this file's wiring).
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
from launcher.config.trainer import ProfileSpec  # noqa: E402  (--profile: the same window and tables as dlaunch's)
from launcher.runtime.profiling import StepProfiler  # noqa: E402
from recipes import charlm  # noqa: E402  (the repository's recipe: the same model and data as dlaunch's)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile-mode", default="default", help="torch.compile's mode (reduce-overhead: CUDA graphs)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--out", required=True)
    parser.add_argument("--profile", metavar="DIR", help="profile steps 33-37 (torch.profiler) into DIR/profile")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(0)
    model = charlm.CharTransformer(args.context, args.d_model, args.heads, args.layers, 0.0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003, fused=device.type == "cuda" or None)
    cfg = charlm.Config(name="charlm", entry="charlm", context=args.context, d_model=args.d_model, heads=args.heads, layers=args.layers)
    train, _ = charlm.make_data(cfg)
    loader = DataLoader(train, batch_size=args.batch, shuffle=True, drop_last=True, pin_memory=device.type == "cuda",
                        generator=torch.Generator().manual_seed(0))
    graphs = args.compile_mode in ("reduce-overhead", "max-autotune")
    mode = None if args.compile_mode == "default" else args.compile_mode
    forward = torch.compile(model, mode=mode) if args.compile else model
    dtype = torch.bfloat16 if args.precision == "bf16" else None

    batches = iter(loader)
    step_seconds, losses = [], {}
    window = ProfileSpec(enabled=args.profile is not None, wait=30, warmup=2, active=5)
    with StepProfiler(window, Path(args.profile) if args.profile else None, "hand", device.type) as prof:
        for step in range(1, args.steps + 1):
            tick = time.perf_counter()
            with prof.region("dlaunch.data"):
                inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
            with prof.region("dlaunch.step"):
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()  # this step's graph outputs replace the last one's
                with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                    logits = forward(inputs)
                    loss = nn.functional.cross_entropy(logits.reshape(-1, charlm.VOCAB), targets.reshape(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if step == 1 or step % args.log_every == 0 or step == args.steps:
                losses[step] = loss.item()
                print(f"step {step}/{args.steps}  loss {losses[step]:.6g}", file=sys.stderr, flush=True)  # as dlaunch logs it
            prof.step()
            step_seconds.append(time.perf_counter() - tick)
    Path(args.out).write_text(json.dumps({
        "steady_ms_per_step": statistics.median(step_seconds[19:]) * 1000,
        "losses": losses,
        "params": sum(p.numel() for p in model.parameters()),
    }))


if __name__ == "__main__":
    main()
