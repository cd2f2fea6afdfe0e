"""Run a Python function on N local worker processes: ``run_function(fn, nproc=2)``.

Each worker is started by torch.distributed.elastic like a ``dlaunch`` worker,
with RANK/WORLD_SIZE/MASTER_* set, so strategies built inside ``fn`` join the
process group by themselves::

    def fn():
        strategy = MirroredStrategy()          # one replica per process
        return strategy.num_replicas_in_sync

    run_function(fn, nproc=2)                  # {0: 2, 1: 2}

``fn`` and its arguments are pickled, so ``fn`` must be importable (defined at
module level, or in the script that calls ``run_function``). Results travel back through
``torch.save`` and are loaded with ``weights_only=True``: return tensors, numbers,
strings, lists, tuples or dicts.

Warm workers: a fresh interpreter spends seconds importing torch before ``fn`` runs,
so the first call starts a ``multiprocessing`` forkserver that imports torch and dlaunch
once, and every call forks its workers from it, as notebook launchers do. Each worker
then takes the caller's environment and working directory as they are at that call, so
it sees what a fresh one would. A call whose environment differs in a variable read
while torch imports (``OMP_NUM_THREADS``, ``TORCH*``, ``PYTHON*``: ``env.import_time_settings``)
starts a new server. A warm worker that has returned stays until every rank has returned (torch
elastic collects function workers' results then): its process group is destroyed, but a peer that
watches its pid sees it running. Forked workers import the calling script as ``__mp_main__``, as
multiprocessing does for its forkserver and spawn children (before the call's environment is in place): keep
its work under ``if __name__ == "__main__":``. ``warm=False`` starts fresh interpreters instead; so do calls
for CUDA workers, calls from a ``dlaunch`` command (its own server forks only its workers) and calls on other
systems than Linux. A call's job and its workers' logs live in a scratch directory (``scratch``), which a later
call removes where a killed caller could not.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from launcher.cluster.env import DEVICE_VARIABLE, WorkerEnv, error_file, import_time_settings, worker_env_set, worker_environment
from launcher.launch import elastic, failures, scratch
from launcher.launch.agents import as_started_now, working_directory
from launcher.launch.parent_death import die_with_parent
from launcher.runtime.streams import reader_may_leave
from launcher.launch import warm as warm_command

MODULE = "launcher.launch.function"
# The server imports what a worker needs before it forks one: this module, dlaunch's worker side (the strategies)
# and torch._dynamo, which a worker's first optimizer imports (3 of a fresh worker's 6-7 CPU-s here).
PRELOAD = ["launcher.launch.forkserver_guard", MODULE, "launcher.runtime.worker", "torch._dynamo"]
_START_ENV = dict(os.environ)  # in the server: the environment it started with, which each worker's differs from
# What torch elastic's agent sets for every worker (LocalElasticAgent._start_workers, torch 2.11-2.13)
_AGENT_SETS = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
               "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
_server: dict[str, Any] = {}  # the server this process started: its pid, and its import-time environment


class WorkerFailed(RuntimeError):
    """A worker of ``run_function`` raised; ``root`` is the first failure."""

    def __init__(self, root: failures.RootCause):
        super().__init__(f"rank {root.rank} failed: {root.exception or root.exit}\n{root.traceback}")
        self.root = root


def run_function(fn: Callable[..., Any], nproc: int = 2, args: tuple = (), timeout_s: int = 120,
                 device: str | None = None, warm: bool = True) -> dict[int, Any]:
    """Call ``fn(*args)`` on ``nproc`` workers; return ``{rank: result}``.

    ``device``: ``"cpu"`` or ``"cuda"`` for the workers' strategies and process group (one GPU per
    process); None: CUDA where there is one, as ``MirroredStrategy()`` chooses.
    ``warm``: fork the workers from a server kept for this process (above); False: fresh interpreters.
    """
    extra_env = {DEVICE_VARIABLE: device} if device else {}
    environ = {**os.environ, **worker_environment(single_node=True), **extra_env}  # what a fresh worker would see
    with scratch.directory() as work:
        job = work / "job.pkl"
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        job.write_bytes(pickle.dumps({
            "payload": pickle.dumps((fn, args)),  # unpickled once paths and __main__ are in place
            "sys_path": sys.path,
            "main_file": main_file if fn.__module__ == "__main__" else None,
            "out": str(work),
            "environ": environ,
            "cwd": working_directory(),  # None: removed; the workers start where the server is
        }))
        config = elastic.local_config(nproc, work / "logs", join_timeout_s=timeout_s)
        forked = _forked_worker if warm and _server_ready(environ, device) else None
        try:
            elastic.start_workers(config, MODULE, job, single_node=True, extra_env=extra_env, forked=forked)
            if forked:  # multiprocessing starts the server again itself where it died just before
                _server["pid"] = forkserver._forkserver._forkserver_pid
        except ChildFailedError as exc:
            # a rank that returned (exit 0) is listed beside the failed ones (elastic._Agent): it is no cause here
            causes = [failures.from_process_failure(r, f) for r, f in exc.failures.items() if f.exitcode != 0]
            raise WorkerFailed(failures.first(causes)) from None
        # map_location: results made on GPUs come back without initialising CUDA in this process
        return {rank: torch.load(work / f"result-{rank}.pt", weights_only=True, map_location="cpu") for rank in range(nproc)}


def _load_main(path: str) -> None:
    """Make the launching script's functions importable as ``__main__`` (as multiprocessing does). A worker forked
    from the server has it already: multiprocessing ran the script as ``__mp_main__`` before the worker started."""
    import runpy
    import types

    module = sys.modules.get("__mp_main__")
    if os.path.normpath(getattr(module, "__file__", None) or "") != os.path.normpath(path):
        module = types.ModuleType("__mp_main__")
        module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _server_ready(environ: Mapping[str, str], device: str | None) -> bool:
    """Whether this process's server runs (started now, or again, if need be) with ``environ``'s import-time
    variables. Not for CUDA workers: forking them is what notebook launchers do, but it is unmeasured here."""
    if sys.platform != "linux" or warm_command.started():  # a dlaunch command's server is for its own workers
        return False
    if device == "cuda" or (device is None and torch.cuda.is_available()):
        return False
    server, wanted = forkserver._forkserver, import_time_settings(environ)
    if server._forkserver_pid is not None and server._forkserver_pid != _server.get("pid"):
        return False  # started by someone else, with other imports: fresh workers
    if server._forkserver_pid is not None and _server["env"] != wanted:
        if warm_command.has_children(server._forkserver_pid):
            return False  # the caller's own processes (a DataLoader's workers) forked from it: it stays
        os.kill(server._forkserver_pid, signal.SIGKILL)  # imported under other settings: a new one
        server._stop()
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    changed = {k: v for k, v in environ.items() if os.environ.get(k) != v}
    # the caller's sys.path for the preloads: before 3.14 the server ignores it (its workers take the caller's own)
    changed["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str))
    with worker_env_set(changed), warm_command.sigint_blocked():
        forkserver.ensure_running()  # at once where it runs; started again where it died
    _server.update(pid=server._forkserver_pid, env=wanted)
    return True


def _forked_worker(job_path: str) -> int:
    """A worker forked from the server: the caller's environment and directory at this call, then as a fresh one."""
    job = pickle.loads(Path(job_path).read_bytes())
    # what the elastic agent set for this rank: whatever it changed, and its own names whatever their value (the
    # caller may have had RANK=1 when the server started, and none now)
    ranked = {k: v for k, v in os.environ.items() if _START_ENV.get(k) != v or k in _AGENT_SETS or k.startswith("TORCHELASTIC_")}
    as_started_now({**job["environ"], **ranked}, job["cwd"])
    code = _worker(Path(job_path))
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)  # the error file says why
    return 0


def _worker(job_path: Path) -> int:
    die_with_parent()  # the caller (its agent), or the server forked from it, which dies with it: no orphans
    reader_may_leave()
    job = pickle.loads(job_path.read_bytes())
    # The launching process's path, in its order (as multiprocessing's spawn does), then this process's own:
    # a directory the launcher appended must not come first here and shadow an installed package.
    sys.path[:] = [*job["sys_path"], *(p for p in sys.path if p not in job["sys_path"])]
    rank = WorkerEnv.from_environ().rank
    try:
        if job["main_file"]:
            _load_main(job["main_file"])  # once: multiprocessing may have run it as __mp_main__ (a forked worker)
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
