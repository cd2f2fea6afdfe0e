"""A worker process's end (launcher/runtime/worker.py): a stopped script's ranks leave at once, wherever they were."""

from __future__ import annotations

import signal
import time

import pytest

from tests.launch.test_restarts import STARTUP_S, finish, run_processes, start, wait_for

DDP_SCRIPT = """import os, pathlib, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
out, rank = pathlib.Path(sys.argv[1]), dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 64)
for step in range(1, 10**9):  # a gradient all-reduce in flight most of the time, as in real training
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if step == 5:
        (out / f"rank{rank}").touch()
"""


@pytest.mark.slow
def test_a_ddp_script_signalled_through_dlaunch_alone_stops_at_once_every_time(tmp_path):
    """SIGINT to the dlaunch process alone (a `kill -INT`, `timeout -s INT`) reaches the ranks through their agent at
    different points of a step. Then 1 run in 3 hung for launch.stop_grace_s and was SIGKILLed, "did not exit within"
    blaming the script: one rank's teardown barrier met the other's gradient all-reduce, and once that was gone,
    freeing the stop's traceback destroyed DDP's gloo group under the GIL while gloo's thread waited for the GIL."""
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    for attempt in range(4):
        run_dir = tmp_path / f"run{attempt}"
        for rank in (0, 1):
            (tmp_path / f"rank{rank}").unlink(missing_ok=True)
        proc = start(run_dir, f"script={tmp_path / 'ddp.py'}", "strategy=mirrored", "cluster=1x2",
                     "launch.stop_grace_s=10", "--", str(tmp_path), common=())
        try:
            wait_for(lambda: all((tmp_path / f"rank{r}").exists() for r in (0, 1)), STARTUP_S, "both ranks training")
            time.sleep(0.1 * attempt)  # a different point in the step each time
            signalled = time.monotonic()
            proc.send_signal(signal.SIGINT)
            wait_for(lambda: proc.poll() is not None, 60, "dlaunch to end")
            took = time.monotonic() - signalled
        finally:
            out = finish(proc, timeout=30)
        assert proc.returncode == 130, out[-3000:]
        assert "did not exit within" not in out and "SIGKILL" not in out, (attempt, took, out[-3000:])
        wait_for(lambda: not run_processes(run_dir), 30, "no process of the run left")
