"""A worker process's end (launcher/runtime/worker.py): a stopped script's ranks leave at once, wherever they were,
and a rank's own processes end with it, as under ``python``."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import dlaunch
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


HELD_LOADER_SCRIPT = """import multiprocessing, os, pathlib, sys, time, torch
out = pathlib.Path(sys.argv[1])

def note_pid(worker_id):
    (out / f"loader-{os.getpid()}").touch()

def last_words():
    time.sleep(1)
    (out / f"child-{os.getpid()}").touch()

if __name__ == "__main__":
    loader = torch.utils.data.DataLoader(torch.arange(64.0), batch_size=4, num_workers=2, worker_init_fn=note_pid)
    batches = iter(loader)  # held to the end, as a script's global loop state is
    next(batches), next(batches)  # one from each worker: both have started
    multiprocessing.Process(target=last_words).start()  # not daemonic: python waits for it at exit
    shared = multiprocessing.Manager().dict()  # never shut down: python's exit ends its server first
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # ended, not yet reaped
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("warm", ["true", "false"])
def test_a_ranks_loader_workers_end_with_it_and_its_own_processes_are_waited_for(warm, tmp_path):
    """A rank leaves with os._exit, which skips what Python's exit does for multiprocessing's children. A loader's
    workers then outlived dlaunch as orphans until their watchdog noticed, up to 5 s later (the forked workers'
    test in test_warm found them under CI's load)."""
    script = tmp_path / "held.py"
    script.write_text(HELD_LOADER_SCRIPT)
    done = dlaunch(f"script={script}", "strategy=mirrored", "cluster=1x2", f"launch.warm_workers={warm}",
                   f"hydra.run.dir={tmp_path / 'run'}", "--", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    loaders = [int(p.name.split("-")[1]) for p in tmp_path.glob("loader-*")]
    assert len(loaders) == 4, sorted(os.listdir(tmp_path))  # 2 ranks x 2 loader workers
    assert [pid for pid in loaders if not _gone(pid)] == []
    assert len(list(tmp_path.glob("child-*"))) == 2  # each rank's own process finished before dlaunch ended


OWN_STRATEGIES = """
import json, os, torch
from launcher import distribute as dl

torch.cuda.is_available = lambda: True  # a GPU machine, as far as choosing a default goes
torch.cuda.device_count = lambda: 1
built = {"env": os.environ.get("DLAUNCH_DEVICE")}
for name in ("MirroredStrategy", "MultiWorkerMirroredStrategy"):
    built[name] = [str(d) for d in getattr(dl, name)().extended._devices]
print("built", json.dumps(built), flush=True)
"""


@pytest.mark.parametrize("shape", [("strategy=mirrored", "cluster=1x2"), ("strategy=one_device", "cluster=1x1")],
                         ids=["workers", "dlaunchs-own-process"])
def test_strategies_a_script_builds_itself_take_the_planned_device_not_the_machines_gpu(tmp_path, shape):
    """`cluster.device=cpu` on a GPU machine: a script's own `dl.MirroredStrategy()` chose cuda:LOCAL_RANK (auto), and
    the run's gloo group met a CUDA device. dlaunch's workers, and its own process for a one-process run, now carry
    the plan's device type (DLAUNCH_DEVICE)."""
    (tmp_path / "own.py").write_text(OWN_STRATEGIES)
    proc = dlaunch("script=own.py", *shape, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("built "))[6:])
    assert built == {"env": "cpu", "MirroredStrategy": ["cpu"], "MultiWorkerMirroredStrategy": ["cpu"]}, built
