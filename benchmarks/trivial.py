"""The trivial script that ``torchrun`` launches in the launch-overhead benchmark (micro.py).

The same work as ``dlaunch recipe=linear trainer.steps=1``: import torch, (join the
gloo group and wrap in DDP when several processes), one SGD step of a 32 -> 1
linear model on a batch of 64. Rank 0 writes the wall-clock time at the end of the step.

    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/trivial.py OUT.json
"""

import json
import os
import sys
import time

import torch

world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    import torch.distributed as dist

    dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(32, 1)
if world > 1:
    model = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
x, y = torch.randn(64 // world, 32), torch.randn(64 // world, 1)
loss = torch.nn.functional.mse_loss(model(x), y)
loss.backward()
optimizer.step()
loss = loss.item()
if int(os.environ.get("RANK", "0")) == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"first_step_time": time.time(), "loss": loss}, f)
if world > 1:  # as dlaunch's workers end: a barrier, then no interpreter teardown (gloo aborts in ~5% of exits here)
    dist.barrier()
    dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
