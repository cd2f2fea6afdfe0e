"""Cluster resolvers: who is in the job, and where this process sits in it.

Names and behaviour follow ``tf.distribute.cluster_resolver``. Every resolver
answers ``cluster_spec()``, ``task_type``, ``task_id``, ``master()`` and
``num_accelerators()``; environment variables are read in ``launcher.cluster.env``.
"""

from __future__ import annotations

import abc
import re
from typing import Any, Mapping

from launcher.cluster import env as env_lib
from launcher.cluster.env import WorkerEnv


class ClusterSpec:
    """Jobs (``"worker"``, ``"ps"``, ``"chief"``, ...) and the addresses of their tasks.

    Example::

        spec = ClusterSpec({"worker": ["host0:2222", "host1:2222"], "ps": ["host2:2222"]})
        spec.num_tasks("worker")           # 2
        spec.task_address("ps", 0)         # "host2:2222"
    """

    def __init__(self, cluster: Mapping[str, Any] | "ClusterSpec" | None = None):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        self._jobs: dict[str, dict[int, str]] = {}
        for job, tasks in (cluster or {}).items():
            if isinstance(tasks, Mapping):
                self._jobs[str(job)] = {int(i): str(a) for i, a in tasks.items()}
            elif isinstance(tasks, (list, tuple)):
                self._jobs[str(job)] = {i: str(a) for i, a in enumerate(tasks)}
            else:
                raise TypeError(f"tasks of job {job!r} must be a list of addresses or a dict index -> address")

    @property
    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def num_tasks(self, job_name: str) -> int:
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        return sorted(self._job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        tasks = self._job(job_name)
        if task_index not in tasks:
            raise ValueError(f"no task with index {task_index} in job {job_name!r}")
        return tasks[task_index]

    def index_on_host(self, task: tuple[str, int], among: list[tuple[str, int]]) -> int:
        """``task``'s place among the tasks ``among`` on its own host (its GPU there): two tasks on ``localhost``
        are 0 and 1, one task per machine is 0 on each."""
        host = self.task_address(*task).rsplit(":", 1)[0]
        return [t for t in among if self.task_address(*t).rsplit(":", 1)[0] == host].index(task)

    def job_tasks(self, job_name: str) -> list[str]:
        return [self._job(job_name)[i] for i in self.task_indices(job_name)]

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """Jobs with contiguous indices as lists, others as dicts (TF's form)."""
        out: dict[str, Any] = {}
        for job, tasks in self._jobs.items():
            dense = sorted(tasks) == list(range(len(tasks)))
            out[job] = [tasks[i] for i in range(len(tasks))] if dense else dict(tasks)
        return out

    def _job(self, job_name: str) -> dict[int, str]:
        if job_name not in self._jobs:
            raise ValueError(f"no such job in cluster: {job_name!r} (jobs: {', '.join(self.jobs) or 'none'})")
        return self._jobs[job_name]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def _with_rpc(address: str, rpc_layer: str | None) -> str:
    return f"{rpc_layer}://{address}" if rpc_layer and address else address


def validate_task(resolver: Any) -> None:
    """A cluster spec needs this process's task: raise ``ValueError`` when it is missing."""
    if resolver.cluster_spec() and (resolver.task_type is None or resolver.task_id is None):
        raise ValueError(
            "a cluster spec is given but task_type or task_id is not: set TF_CONFIG's "
            '"task": {"type": ..., "index": ...} (or pass task_type and task_id)'
        )


class ClusterResolver(abc.ABC):
    """What every resolver answers: the cluster, this task's place in it, and its devices.

    A subclass implements ``cluster_spec()`` and ``master()`` and sets ``task_type``,
    ``task_id``, ``rpc_layer`` and ``environment``::

        class OneTask(ClusterResolver):
            task_type, task_id = "worker", 0
            def cluster_spec(self):
                return ClusterSpec({"worker": ["localhost:2222"]})
            def master(self, task_type=None, task_id=None, rpc_layer=None):
                return "localhost:2222"
    """

    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None
    environment: str = ""

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The current cluster (it may change between calls, as a scheduler moves tasks)."""

    @abc.abstractmethod
    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of a task (this one's session target by default)."""

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None) -> dict[str, int]:
        """Accelerators per task, by type (``{"GPU": 2}``); none by default."""
        return {}


class SimpleClusterResolver(ClusterResolver):
    """A resolver over a ``ClusterSpec`` given in code."""

    def __init__(self, cluster_spec: ClusterSpec | Mapping, master: str = "", task_type: str | None = None,
                 task_id: int | None = None, environment: str = "", num_accelerators: Mapping[str, int] | None = None,
                 rpc_layer: str | None = None):
        self._spec = ClusterSpec(cluster_spec)
        self._master = master
        self.task_type, self.task_id = task_type, task_id
        self.environment = environment
        self.rpc_layer = rpc_layer
        self._accelerators = dict(num_accelerators or {})

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        if task_type is not None and task_id is not None:
            return _with_rpc(self._spec.task_address(task_type, task_id), rpc_layer or self.rpc_layer)
        return _with_rpc(self._master, rpc_layer or self.rpc_layer) if self._master else ""

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None) -> dict[str, int]:
        return dict(self._accelerators)


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster and this task from the ``TF_CONFIG`` JSON.

    ``TF_CONFIG`` looks like ``{"cluster": {"chief": [...], "worker": [...], "ps": [...],
    "evaluator": [...]}, "task": {"type": "worker", "index": 0}}``.
    """

    def __init__(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None,
                 environment: str | None = None, environ: Mapping[str, str] | None = None):
        config = env_lib.tf_config(environ)
        task = config.get("task", {}) or {}
        self._spec = ClusterSpec(config.get("cluster", {}))
        self.task_type = task_type if task_type is not None else task.get("type")
        index = task_id if task_id is not None else task.get("index")
        self.task_id = int(index) if index is not None else None
        self.rpc_layer = rpc_layer if rpc_layer is not None else config.get("rpc_layer")
        self.environment = environment if environment is not None else config.get("environment", "")
        if self.task_type is not None and self._spec and self.task_type not in self._spec.jobs:
            raise ValueError(f"TF_CONFIG task type {self.task_type!r} is not a job of the cluster ({', '.join(self._spec.jobs)})")

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of ``task_type:task_id`` (default: this task), with the rpc layer as a scheme."""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None or not self._spec:
            return ""
        return _with_rpc(self._spec.task_address(task_type, task_id), rpc_layer or self.rpc_layer)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None) -> dict[str, int]:
        import torch

        return {"GPU": torch.cuda.device_count()} if torch.cuda.is_available() else {}


class TorchElasticClusterResolver(ClusterResolver):
    """Describes a job started by torch.distributed.elastic (dlaunch or torchrun).

    Every process is a ``worker``; ``task_id`` is its global rank (RANK).
    """

    def __init__(self, env: WorkerEnv | None = None, device_type: str = "cpu"):
        self._env = env or WorkerEnv.from_environ()
        if self._env is None:
            raise ValueError("not a torch.distributed.elastic worker: RANK and WORLD_SIZE are not set")
        self._device_type = device_type
        self.rpc_layer = None
        self.environment = ""

    @property
    def env(self) -> WorkerEnv:
        """The launcher's description of this worker."""
        return self._env

    @property
    def task_type(self) -> str:
        return "worker"

    @property
    def task_id(self) -> int:
        return self._env.rank

    def cluster_spec(self) -> ClusterSpec:
        """``{"worker": [...]}``, one entry per process.

        torch's rendezvous does not publish worker addresses, so each entry names the
        job's store (``master()``); the list's length is the number of workers.
        """
        return ClusterSpec({"worker": [self.master()] * self._env.world_size})

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        return _with_rpc(f"{self._env.master_addr}:{self._env.master_port}", rpc_layer)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None) -> dict[str, int]:
        """Accelerators this task uses: one GPU per process on CUDA, none on CPU."""
        return {"GPU": 1} if self._device_type == "cuda" else {}

    def __repr__(self) -> str:
        return f"TorchElasticClusterResolver(task_type='worker', task_id={self.task_id}, world_size={self._env.world_size})"


class SlurmClusterResolver(ClusterResolver):
    """Reads the tasks of a SLURM job step from SLURM's variables.

    Tasks are numbered by SLURM_PROCID and laid out over the step's nodes in order,
    as many per node as SLURM_STEP_TASKS_PER_NODE says; each task gets the address
    ``node:port_base + local index``.
    """

    def __init__(self, jobs: Mapping[str, int] | None = None, port_base: int = 8888, gpus_per_node: int | None = None,
                 gpus_per_task: int | None = None, tasks_per_node: Mapping[str, int] | None = None,
                 rpc_layer: str | None = None, environ: Mapping[str, str] | None = None):
        vars_ = env_lib.slurm(environ)
        if "SLURM_PROCID" not in vars_:
            raise ValueError("not inside a SLURM job step: SLURM_PROCID is not set")
        nodes = expand_hostlist(vars_.get("SLURM_STEP_NODELIST") or vars_.get("SLURM_JOB_NODELIST", ""))
        per_node = expand_tasks_per_node(vars_.get("SLURM_STEP_TASKS_PER_NODE") or vars_.get("SLURM_TASKS_PER_NODE", ""), len(nodes))
        if tasks_per_node:
            per_node = [tasks_per_node.get(n, 0) for n in nodes]
        self._addresses = [f"{node}:{port_base + i}" for node, count in zip(nodes, per_node) for i in range(count)]
        total = int(vars_.get("SLURM_STEP_NUM_TASKS") or vars_.get("SLURM_NTASKS") or len(self._addresses))
        if total != len(self._addresses):
            raise ValueError(f"SLURM says {total} tasks, but its node list lays out {len(self._addresses)}")
        self._jobs = dict(jobs or {"worker": total})
        if sum(self._jobs.values()) != total:
            raise ValueError(f"jobs {self._jobs} ask for {sum(self._jobs.values())} tasks, but the SLURM step has {total}")
        self._proc_id = int(vars_["SLURM_PROCID"])
        self._gpus_per_node, self._gpus_per_task = gpus_per_node, gpus_per_task
        self.rpc_layer = rpc_layer
        self.environment = ""
        self.task_type, self.task_id = self._task_of(self._proc_id)

    def _task_of(self, proc_id: int) -> tuple[str, int]:
        start = 0
        for job, count in self._jobs.items():
            if proc_id < start + count:
                return job, proc_id - start
            start += count
        raise ValueError(f"SLURM_PROCID {proc_id} is beyond the {start} tasks of the step")

    def cluster_spec(self) -> ClusterSpec:
        spec, start = {}, 0
        for job, count in self._jobs.items():
            spec[job] = self._addresses[start : start + count]
            start += count
        return ClusterSpec(spec)

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        return _with_rpc(self.cluster_spec().task_address(task_type, task_id), rpc_layer or self.rpc_layer)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None) -> dict[str, int]:
        if self._gpus_per_task is not None:
            return {"GPU": self._gpus_per_task} if self._gpus_per_task else {}
        return {"GPU": self._gpus_per_node} if self._gpus_per_node else {}


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list: ``"n[1-3,7],gpu01"`` -> ``["n1", "n2", "n3", "n7", "gpu01"]``."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            for n in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{str(n).zfill(len(low))}{suffix}")
    return hosts


def expand_tasks_per_node(text: str, num_nodes: int) -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"cannot read SLURM tasks per node {text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts or [1] * num_nodes


def of_launched_job(env: WorkerEnv | None, device_type: str) -> TorchElasticClusterResolver | None:
    """A strategy's ``cluster_resolver`` in a job of processes that dlaunch or torchrun started (``env``, from the
    environment); None outside one: a single worker has none, as in TF."""
    return TorchElasticClusterResolver(env, device_type) if env is not None else None
