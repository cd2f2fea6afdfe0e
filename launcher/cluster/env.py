"""The one module that reads environment variables.

torch.distributed.elastic describes each worker through its environment
(RANK, LOCAL_RANK, WORLD_SIZE, ...). Everything else in dlaunch receives a
``WorkerEnv`` instead of reading ``os.environ``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Iterator, Mapping


ROUND_VARIABLE = "DLAUNCH_RDZV_ROUND"  # the rendezvous round the agent started these workers in (launch/agent.py)
DEVICE_VARIABLE = "DLAUNCH_DEVICE"  # the device type for workers' own strategies: the plan's, run_function(device=...)'s


@dataclasses.dataclass(frozen=True)
class WorkerEnv:
    """Where this process sits in the job, as the elastic agent (or torchrun) says."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int  # the node's rank
    master_addr: str
    master_port: int
    restart_count: int = 0  # this node's restarts of its workers (a node started again counts from 0)
    run_id: str = ""
    agent_store: bool = False  # MASTER_ADDR:MASTER_PORT is the elastic agent's store, shared by every attempt
    device_type: str | None = None  # cpu | cuda as the launcher chose (dlaunch's plan, run_function(device=...)); None: auto
    attempt: int = 0  # the same on every node for one start of the job's workers: the key space of its stores' keys

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "WorkerEnv | None":
        """The worker's position, or None when this process was not started by a launcher."""
        env = os.environ if environ is None else environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        world = int(env["WORLD_SIZE"])
        local = next((names for names in _LOCAL if env.get(names[0], "").isdigit()), None)
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env[local[0]] if local else env["RANK"]),
            world_size=world,
            local_world_size=int(env.get(local[1], world) if local else env.get("LOCAL_WORLD_SIZE", world)),
            group_rank=int(env.get("GROUP_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 0)),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            device_type=env.get(DEVICE_VARIABLE) or None,
            attempt=int(env.get(ROUND_VARIABLE) or env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )


# Where a launcher other than torchrun (srun, mpirun) started the process: its own names for the rank on this node
# (a GPU index) and the processes of this node, both from the same launcher. RANK alone would send rank 12 of a
# 2x8 job to cuda:12.
_LOCAL = (("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
          ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"))


@dataclasses.dataclass(frozen=True)
class PSTask:
    """This process's task in a parameter-server job, as dlaunch's task launcher says (``DLAUNCH_TASK``)."""

    type: str  # chief | worker | ps
    index: int
    rank: int  # chief 0, workers 1..N, ps N+1..: the task's place in the job
    attempt: int = 0  # how many times the job's tasks were restarted before this one

    @property
    def name(self) -> str:
        return f"{self.type}:{self.index}"


TASK_VARIABLES = ("DLAUNCH_TASK", "DLAUNCH_TASK_RANK", "DLAUNCH_ATTEMPT")


def emulated_node_devices(node_rank: int, per_node: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for one emulated node of a CUDA job: its own ``per_node`` devices, the ``node_rank``-th
    slice of those this process sees (its own ``CUDA_VISIBLE_DEVICES`` where set), so that every node's local ranks
    0..per_node-1 name different GPUs."""
    env = os.environ if environ is None else environ
    seen = env.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in seen.split(",") if d.strip()] if seen else [str(i) for i in range((node_rank + 1) * per_node)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[node_rank * per_node:(node_rank + 1) * per_node])}


def narrow_local_task_devices(node_rank: int, per_node: int) -> None:
    """A ``submitit_local`` task (one node of several on this machine) keeps its own slice of the GPUs submitit
    showed every task, before its workers start; a SLURM task's GPUs are its node's own already."""
    if "SUBMITIT_LOCAL_GLOBALID" in os.environ and os.environ.get("CUDA_VISIBLE_DEVICES"):
        os.environ.update(emulated_node_devices(node_rank, per_node))


def ps_task(environ: Mapping[str, str] | None = None) -> PSTask | None:
    """This process's parameter-server task, or None outside a parameter-server job."""
    env = os.environ if environ is None else environ
    if "DLAUNCH_TASK" not in env:
        return None
    kind, _, index = env["DLAUNCH_TASK"].partition(":")
    return PSTask(kind, int(index), int(env.get("DLAUNCH_TASK_RANK", 0)), int(env.get("DLAUNCH_ATTEMPT", 0)))


def task_environment(task: PSTask) -> dict[str, str]:
    """What the task launcher sets for a task's process; TensorPipe's per-connection warnings stay quiet."""
    return {"DLAUNCH_TASK": task.name, "DLAUNCH_TASK_RANK": str(task.rank), "DLAUNCH_ATTEMPT": str(task.attempt),
            **quiet_cpp_variables()}


def torch_settings(environ: Mapping[str, str], threads: bool = False) -> dict[str, str]:
    """The ``TORCH*`` variables of ``environ`` that torch reads as it loads (``threads``: and ``OMP_NUM_THREADS``): a
    process forked from one where torch loaded under other ones would not be what a fresh one is. Not elastic's own
    (``TORCHELASTIC_*``, set per worker), nor ``TORCHINDUCTOR_CACHE_DIR`` at the default that torch sets itself as
    inductor first finds its cache, in whichever process that happens."""
    return _without_default_cache({k: v for k, v in environ.items() if k.startswith("TORCH") and not k.startswith("TORCHELASTIC_")
                                   or threads and k == "OMP_NUM_THREADS"})


# What a process reads as it starts and imports torch: threads and their runtimes, torch's own switches, Python's
# flags (PYTHONUNBUFFERED, PYTHONHASHSEED, PYTHONPATH) and the loader's paths.
_IMPORT_TIME = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH", "PYTHON", "LD_")


def import_time_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` read as a process starts and imports torch: a process forked from one that
    started under other ones would not be what a fresh one is. Not elastic's own (``TORCHELASTIC_*``, set per
    worker; its agent sets ``TORCHELASTIC_SIGNALS_TO_HANDLE`` in its own process), nor ``TORCHINDUCTOR_CACHE_DIR``
    at torch's own default (``torch_settings``)."""
    return _without_default_cache(
        {k: v for k, v in environ.items() if k.startswith(_IMPORT_TIME) and not k.startswith("TORCHELASTIC_")})


def _without_default_cache(settings: dict[str, str]) -> dict[str, str]:
    if "TORCHINDUCTOR_CACHE_DIR" in settings and settings["TORCHINDUCTOR_CACHE_DIR"] == _default_inductor_cache():
        del settings["TORCHINDUCTOR_CACHE_DIR"]
    return settings


def _default_inductor_cache() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # torch-free; torch 2.11-2.13 have it
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def quiet_cpp_variables() -> dict[str, str]:
    """torch's C++ warnings off (errors still print), unless the user set ``TORCH_CPP_LOG_LEVEL``: read as torch loads."""
    return {"TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}


def quiet_cpp_warnings() -> None:
    """Before torch loads, for a run on several nodes: where a node's store goes away (node 0 killed, the network
    dropped), torch's C++ store client prints each failed send as a warning with dozens of ``frame #N`` lines, on
    the agent and every worker; dlaunch says it once in its own words (the store went away, the rank it took).
    Errors still print, and a ``TORCH_CPP_LOG_LEVEL`` the user set stands. Workers inherit it."""
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:
        _QUIETED.append(True)
    os.environ.update(quiet_cpp_variables())


_QUIETED: list[bool] = []  # quiet_cpp_warnings set TORCH_CPP_LOG_LEVEL (the user had not)


def unquiet_cpp_warnings() -> None:
    """The command line looked like several nodes and the validated job has one (``cluster.nodes=${oc.env:N}``
    with N=1, a shape given twice): its workers start with torch's own log level, not the one set on the guess."""
    if _QUIETED:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        _QUIETED.clear()


def tf_config(environ: Mapping[str, str] | None = None) -> dict:
    """The ``TF_CONFIG`` JSON (cluster, task, rpc_layer, environment), or ``{}`` when unset."""
    import json

    text = (os.environ if environ is None else environ).get("TF_CONFIG", "")
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("TF_CONFIG must be a JSON object with 'cluster' and 'task'")
    return data


SLURM_VARIABLES = (
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_JOB_ID",
)


def slurm(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The SLURM_* variables a SLURM job step describes its tasks with (empty outside SLURM)."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in SLURM_VARIABLES if k in env}


def scheduler_tasks(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """This job step's tasks in SLURM's variables: SLURM's own, or submitit's local executor's in SLURM terms.

    ``hydra/launcher=submitit_local`` runs its tasks on this machine and describes
    them with SUBMITIT_LOCAL_* variables; translated, the same SLURM resolver reads both.
    """
    env = os.environ if environ is None else environ
    found = slurm(env)
    if "SLURM_PROCID" in found:
        return found
    if "SUBMITIT_LOCAL_GLOBALID" not in env:
        return {}
    tasks = env.get("SUBMITIT_LOCAL_NTASKS", "1")
    return {
        "SLURM_PROCID": env["SUBMITIT_LOCAL_GLOBALID"], "SLURM_NTASKS": tasks, "SLURM_JOB_NODELIST": "localhost",
        "SLURM_TASKS_PER_NODE": tasks, "SLURM_JOB_ID": env.get("SUBMITIT_LOCAL_JOB_ID", "0"),
    }


def torchrun_single_process(port: int) -> dict[str, str]:
    """What ``torchrun --nproc_per_node=1`` gives its worker, for a script run in dlaunch's own process: a script
    that reads ``LOCAL_RANK`` or calls ``init_process_group()`` runs as it does under torchrun."""
    return {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


RUN_DIR_VARIABLE = "DLAUNCH_RUN_DIR"  # a script's run directory (absolute), in every process that runs it


def script_run_dir() -> Path | None:
    """A script's run directory, from ``DLAUNCH_RUN_DIR`` (None outside dlaunch)."""
    value = os.environ.get(RUN_DIR_VARIABLE)
    return Path(value) if value else None


def script_environment(run_dir: Path) -> dict[str, str]:
    """What a script finds in its environment besides torchrun's variables: ``DLAUNCH_RUN_DIR``, where it writes its
    own files (``metrics.jsonl`` for ``dlaunch report``, its checkpoints)."""
    return {RUN_DIR_VARIABLE: str(Path(run_dir).resolve())}


def announced_device() -> str | None:
    """The device type the launcher chose for this process's own strategies (``DEVICE_VARIABLE``); None: auto."""
    return os.environ.get(DEVICE_VARIABLE) or None


def announce_device(device_type: str) -> None:
    """The plan's device type, for strategies this worker's own code builds (``dl.MirroredStrategy()`` in a script)
    and for its children: they take it, not a GPU the machine happens to have (``cluster.device=cpu`` there)."""
    os.environ[DEVICE_VARIABLE] = device_type


def error_file() -> str | None:
    """Where the elastic agent wants this worker's root-cause error (JSON)."""
    return os.environ.get("TORCHELASTIC_ERROR_FILE")


def disk_full_at(step: int, environ: Mapping[str, str] | None = None) -> bool:
    """Tests only: ``DLAUNCH_TEST_DISK_FULL_AT_STEP=N`` makes the save of step N fail with ENOSPC, ``N+`` the save of
    every step from N on (checkpoint/writer.py)."""
    value = (os.environ if environ is None else environ).get("DLAUNCH_TEST_DISK_FULL_AT_STEP", "").strip()
    on = value.endswith("+")
    value = value.removesuffix("+")
    return value.isdigit() and (step >= int(value) if on else step == int(value))


def full_errors() -> bool:
    """``HYDRA_FULL_ERROR=1`` (or ``DLAUNCH_DEBUG=1``) shows Python tracebacks for config errors too."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("DLAUNCH_DEBUG") == "1"


# gloo, NCCL's bootstrap and tensorpipe (torch.distributed.rpc) each pick the interface they listen on from these.
LOOPBACK_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def nccl_settings(trace_prefix: str) -> tuple[tuple[tuple[str, ...], str], ...]:
    """NCCL's own hang tooling: (the names torch 2.13 reads a setting under, the value dlaunch gives it)."""
    return (
        (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"), "1"),  # a timed-out collective ends the process
        (("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"), "2000"),  # the flight recorder keeps the last collectives
        (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),  # ... and writes them out when one times out
        (("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"), trace_prefix),  # ... to this prefix + rank
    )


def worker_environment(
    single_node: bool, nccl_trace_prefix: str | None = None, environ: Mapping[str, str] | None = None,
    interface: str | None = None,
) -> dict[str, str]:
    """Variables the launcher sets for its workers; a value the user set is kept.

    Single-node jobs keep every collective transport (gloo, NCCL's bootstrap,
    tensorpipe) on the loopback interface, so that nothing listens on a routable
    address. A node of a multi-node job puts them on ``interface``, the one whose
    route reaches the master (cluster/interface.py). With ``nccl_trace_prefix``
    (an nccl job), NCCL's async error handling and flight recorder are on, and a
    timeout dumps each rank's recent collectives to ``nccl_trace_prefix`` + rank.
    """
    env = os.environ if environ is None else environ
    extra = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
    if single_node:
        loopback = _loopback_interface()
        extra.update({name: env.get(name, loopback) for name in LOOPBACK_INTERFACE_VARIABLES})
    elif interface:
        extra.update({name: env.get(name, interface) for name in LOOPBACK_INTERFACE_VARIABLES})
    if nccl_trace_prefix is not None:
        for names, value in nccl_settings(nccl_trace_prefix):
            if not any(name in env for name in names):  # the user's setting, under any of its names, stays
                extra[names[0]] = value
    return extra


def collective_interface(backend: str, environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """The variable that chooses ``backend``'s interface, and its value in this process (None: unset)."""
    name = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    return name, (os.environ if environ is None else environ).get(name) or None


def user_interface_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The interface variables the user set for this launch (dlaunch keeps them)."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in LOOPBACK_INTERFACE_VARIABLES if env.get(name)}


@contextlib.contextmanager
def worker_env_set(extra: Mapping[str, str]) -> Iterator[None]:
    """``extra`` in this process's environment for the duration: what the workers it starts inherit."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _loopback_interface() -> str:
    try:
        import socket

        for _, name in socket.if_nameindex():
            if name == "lo" or name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"
