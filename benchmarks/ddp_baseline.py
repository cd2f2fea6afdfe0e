"""Baseline: hand-written DDP (gloo, DistributedSampler), 1 thread per process.

    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/ddp_baseline.py --steps 200 --out ddp.json
    ... benchmarks/ddp_baseline.py --no-sync ...           # gradient sync switched off: the compute floor
    ... benchmarks/ddp_baseline.py --layout contiguous ... # dlaunch's split of each global batch, bit for bit

``DistributedSampler(shuffle=True, seed=seed)`` permutes with ``seed + epoch``
exactly as dlaunch's ``EpochBatchSampler`` does and deals the permutation out
round-robin, so global batch ``k`` holds the same 256 examples under both; rank
``r`` gets rows ``r, r+2, ...`` of it here, the contiguous half
``[128r, 128r+128)`` under dlaunch. The mean gradient is the same up to the
order of float additions. ``--layout contiguous`` gives each rank dlaunch's
half instead (still through ``DistributedSampler``, over the epoch's order laid
out so that its round-robin deal yields the halves): then the losses equal
dlaunch mirrored's bit for bit. With ``--no-sync`` every step runs under
``ddp.no_sync()``: no all-reduce, the replicas drift apart (its loss is not
comparable). Losses are read (``.item()``) only at the steps dlaunch logs (1,
every 20th, the last) and averaged over the ranks after the timed loop.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as w  # noqa: E402


def contiguous_deal(order: list[int], world: int) -> list[int]:
    """``order`` rearranged so that dealing it round-robin gives rank ``r`` rows ``[r*b, (r+1)*b)`` of each global batch."""
    b = w.GLOBAL_BATCH // world
    out = []
    for start in range(0, len(order) - len(order) % w.GLOBAL_BATCH, w.GLOBAL_BATCH):
        batch = order[start : start + w.GLOBAL_BATCH]
        out += [batch[r * b + j] for j in range(b) for r in range(world)]
    return out


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-sync", action="store_true", help="skip the gradient all-reduce (the compute floor)")
    parser.add_argument("--layout", choices=("interleaved", "contiguous"), default="interleaved",
                        help="interleaved: DistributedSampler(shuffle=True) as usual; contiguous: dlaunch's halves")
    parser.add_argument("--phases", action="store_true", help="also time data, forward, backward, optimizer (breakdown.py)")
    parser.add_argument("--out", required=True, help="JSON file for the harness (rank 0 writes it)")
    return parser.parse_args()


def _batches(args: argparse.Namespace, rank: int, world: int):
    """This rank's batches, epoch after epoch, through DistributedSampler as a hand-written DDP script reads them."""
    data = w.make_data(args.seed)
    if args.layout == "contiguous":
        source = Subset(data, contiguous_deal(w.epoch_order(args.seed, 0), world))  # its length fixes the sampler's
        sampler = DistributedSampler(source, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    else:
        source = data
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(source, batch_size=w.GLOBAL_BATCH // world, sampler=sampler, drop_last=True)
    epoch = 0
    while True:
        if args.layout == "contiguous":
            source.indices = contiguous_deal(w.epoch_order(args.seed, epoch), world)
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
        if not len(loader):
            raise ValueError("the loader yields no batch")


def main() -> None:
    args = _args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    model = DistributedDataParallel(w.make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    stream = _batches(args, rank, world)
    step_seconds: list[float] = []
    first_step_time = 0.0
    logged: dict[int, torch.Tensor] = {}
    phases: list[list[float]] = []
    for step in range(1, args.steps + 1):
        tick = time.perf_counter()
        x, y = next(stream)
        if args.phases:  # backward includes waiting for DDP's all-reduce (it overlaps with backward, then finishes)
            t = [time.perf_counter()]
            with model.no_sync() if args.no_sync else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(model(x), y)
                t.append(time.perf_counter())
                loss.backward()
                t.append(time.perf_counter())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t.append(time.perf_counter())
            phases.append([t[0] - tick, t[1] - t[0], t[2] - t[1], t[3] - t[2]])
        else:
            with model.no_sync() if args.no_sync else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if w.logged(step, args.steps):
            logged[step] = loss.detach()
            if step == 1:
                first_step_time = time.time()
        step_seconds.append(time.perf_counter() - tick)
    steps = sorted(logged)
    losses = torch.stack([logged[s] for s in steps])
    dist.all_reduce(losses)  # after the timed loop: each logged step's global-batch mean loss
    losses /= world
    if rank == 0:
        w.write_result(args.out, first_step_time=first_step_time, step_seconds=step_seconds,
                       logged_losses={s: float(v) for s, v in zip(steps, losses)}, threads=torch.get_num_threads(),
                       world_size=world, no_sync=args.no_sync, layout=args.layout, phases=phases)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as dlaunch's workers end: gloo aborts at interpreter exit in ~5% of 2-process runs here


if __name__ == "__main__":
    main()
