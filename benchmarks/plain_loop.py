"""Baseline: a plain single-process training loop, hand-written torch, 2 threads.

    .venv/bin/python benchmarks/plain_loop.py --steps 200 --out plain.json

Same data, initial parameters and example order as ``dlaunch recipe=bench_mlp``
(its global batch ``k`` of epoch ``e`` is rows ``k*256 .. k*256+255`` of
``randperm(65536, seed + e)``), so its losses equal dlaunch one_device's bit for
bit. Losses are read (``.item()``) only at the steps dlaunch logs (1, every 20th, the last).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as w  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--phases", action="store_true", help="also time data, forward, backward, optimizer (breakdown.py)")
    parser.add_argument("--out", required=True, help="JSON file for the harness")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    model = w.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    data = w.make_data(args.seed)

    def batches():
        epoch = 0
        while True:
            yield from DataLoader(data, batch_size=w.GLOBAL_BATCH, sampler=w.epoch_order(args.seed, epoch), drop_last=True)
            epoch += 1

    stream = batches()
    step_seconds: list[float] = []
    first_step_time = 0.0
    logged: dict[int, float] = {}
    phases: list[list[float]] = []
    for step in range(1, args.steps + 1):
        tick = time.perf_counter()
        x, y = next(stream)
        if args.phases:
            t = [time.perf_counter()]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            t.append(time.perf_counter())
            loss.backward()
            t.append(time.perf_counter())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t.append(time.perf_counter())
            phases.append([t[0] - tick, t[1] - t[0], t[2] - t[1], t[3] - t[2]])
        else:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if w.logged(step, args.steps):
            logged[step] = loss.item()
            if step == 1:
                first_step_time = time.time()
        step_seconds.append(time.perf_counter() - tick)
    w.write_result(args.out, first_step_time=first_step_time, step_seconds=step_seconds, logged_losses=logged,
                   threads=torch.get_num_threads(), phases=phases)


if __name__ == "__main__":
    main()
