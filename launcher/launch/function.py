"""Run a Python function on N local worker processes: ``run_function(fn, nproc=2)``.

Each worker is started by torch.distributed.elastic like a ``dlaunch`` worker,
with RANK/WORLD_SIZE/MASTER_* set, so strategies built inside ``fn`` join the
process group by themselves::

    def fn():
        strategy = MirroredStrategy()          # one replica per process
        return strategy.num_replicas_in_sync

    run_function(fn, nproc=2)                  # {0: 2, 1: 2}

``fn`` and its arguments are pickled, so ``fn`` must be importable (defined at
module level). Results travel back through ``torch.save`` and are loaded with
``weights_only=True``: return tensors, numbers, strings, lists, tuples or dicts.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from launcher.cluster.env import DEVICE_VARIABLE, WorkerEnv, error_file
from launcher.launch import elastic, failures

MODULE = "launcher.launch.function"


class WorkerFailed(RuntimeError):
    """A worker of ``run_function`` raised; ``root`` is the first failure."""

    def __init__(self, root: failures.RootCause):
        super().__init__(f"rank {root.rank} failed: {root.exception or root.exit}\n{root.traceback}")
        self.root = root


def run_function(fn: Callable[..., Any], nproc: int = 2, args: tuple = (), timeout_s: int = 120,
                 device: str | None = None) -> dict[int, Any]:
    """Call ``fn(*args)`` on ``nproc`` workers; return ``{rank: result}``.

    ``device``: ``"cpu"`` or ``"cuda"`` for the workers' strategies and process group (one GPU per
    process); None: CUDA where there is one, as ``MirroredStrategy()`` chooses.
    """
    with tempfile.TemporaryDirectory(prefix="dlaunch-fn-") as tmp:
        work = Path(tmp)
        job = work / "job.pkl"
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        job.write_bytes(pickle.dumps({
            "payload": pickle.dumps((fn, args)),  # unpickled once paths and __main__ are in place
            "sys_path": sys.path,
            "main_file": main_file if fn.__module__ == "__main__" else None,
            "out": str(work),
        }))
        config = elastic.local_config(nproc, work / "logs", join_timeout_s=timeout_s)
        try:
            elastic.start_workers(config, MODULE, job, single_node=True, extra_env={DEVICE_VARIABLE: device} if device else None)
        except ChildFailedError as exc:
            # a rank that returned (exit 0) is listed beside the failed ones (elastic._Agent): it is no cause here
            causes = [failures.from_process_failure(r, f) for r, f in exc.failures.items() if f.exitcode != 0]
            raise WorkerFailed(failures.first(causes)) from None
        # map_location: results made on GPUs come back without initialising CUDA in this process
        return {rank: torch.load(work / f"result-{rank}.pt", weights_only=True, map_location="cpu") for rank in range(nproc)}


def _load_main(path: str) -> None:
    """Make the launching script's functions importable as ``__main__`` (as multiprocessing does)."""
    import runpy
    import types

    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _worker(job_path: Path) -> int:
    job = pickle.loads(job_path.read_bytes())
    # The launching process's path, in its order (as multiprocessing's spawn does), then this process's own:
    # a directory the launcher appended must not come first here and shadow an installed package.
    sys.path[:] = [*job["sys_path"], *(p for p in sys.path if p not in job["sys_path"])]
    rank = WorkerEnv.from_environ().rank
    try:
        if job["main_file"]:
            _load_main(job["main_file"])
        fn, args = pickle.loads(job["payload"])
        result = fn(*args)
        torch.save(result, Path(job["out"]) / f"result-{rank}.pt")
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported by the launching process
        failures.write_error_file(error_file(), exc, rank)
        return 1


if __name__ == "__main__":
    code = _worker(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
