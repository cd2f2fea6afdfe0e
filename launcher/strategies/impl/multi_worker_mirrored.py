"""``MultiWorkerMirroredStrategy``: synchronous data parallelism across workers.

The workers and this process's place among them come from a cluster resolver:

* ``TFConfigClusterResolver`` (the default when ``TF_CONFIG`` is set): the
  ``chief`` and ``worker`` tasks form the group, in that order; the first one's
  address hosts the rendezvous store, listening on that host only.
* ``TorchElasticClusterResolver`` (the default under dlaunch or torchrun).
* No cluster: one worker, replicas on this machine's devices.

Example (run once per task, each with its own TF_CONFIG)::

    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": ["localhost:12345", "localhost:23456"]},
        "task": {"type": "worker", "index": 0}})
    strategy = MultiWorkerMirroredStrategy()
    strategy.cluster_resolver.task_type   # "worker"
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import logging
from typing import Any

import torch
import torch.distributed as dist

from launcher.cluster.env import WorkerEnv, script_run_dir, tf_config
from launcher.cluster.process_group import default_backend, ensure_process_group, process_device
from launcher.cluster.resolvers import TFConfigClusterResolver, TorchElasticClusterResolver, validate_task
from launcher.distribute import cross_device_ops as cdo
from launcher.distribute import devices as devlib
from launcher.distribute.collectives import ProcessCollectives
from launcher.distribute.context import has_strategy
from launcher.distribute.strategy import Strategy
from launcher.strategies import Runtime
from launcher.strategies.impl.mirrored import _MirroredExtended

GROUP_JOBS = ("chief", "worker")
log = logging.getLogger("dlaunch")


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to use: AUTO picks nccl on CUDA, gloo (a ring) on CPU."""

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    timeout_seconds: float | None = None


def _backend(options: CommunicationOptions, device_type: str) -> str:
    if options.implementation is CommunicationImplementation.NCCL:
        return "nccl"
    if options.implementation is CommunicationImplementation.RING:
        return "gloo"
    return default_backend(device_type)


def default_resolver() -> Any:
    """``TF_CONFIG``'s, else the launcher's workers (TF's default: one of its own even where ``TF_CONFIG`` is unset, a
    lone worker with an empty cluster, so that ``strategy.cluster_resolver.task_type`` reads as in TF). In a dlaunch
    job (a script's process) dlaunch's plan stands: a ``TF_CONFIG`` left in the environment is not its cluster (the
    command said so, ``cli/main.py``), and reading it would wait on tasks that were never started."""
    env = WorkerEnv.from_environ()
    config = tf_config()
    in_job = script_run_dir() is not None and has_strategy()  # dlaunch runs a script with its strategy set
    if config and not in_job:
        return TFConfigClusterResolver()
    tasks = sum(len(v) for k, v in (config.get("cluster") or {}).items() if k in GROUP_JOBS)
    if tasks > 1:
        log.warning("TF_CONFIG lists %d tasks, but this process runs in a dlaunch job (%d process(es)): dlaunch's "
                    "plan stands, TF_CONFIG is not read (cluster=tasks gives dlaunch a task list)", tasks,
                    env.world_size if env else 1)
    return TorchElasticClusterResolver(env) if env is not None else TFConfigClusterResolver(environ={})


def _join_tf_config_group(resolver: Any, backend: str, timeout_s: float, kind: str) -> tuple[bool, torch.device | None]:
    """Init the process group of the chief and worker tasks: whether there is one of several, and this task's device
    (None: the default). False if this task is not one of them."""
    spec = resolver.cluster_spec()
    if resolver.task_type == "ps":
        raise ValueError("MultiWorkerMirroredStrategy has no ps tasks; parameter servers are strategy=parameter_server")
    members = [(job, i) for job in GROUP_JOBS if job in spec.jobs for i in spec.task_indices(job)]
    me = (resolver.task_type, resolver.task_id)
    if me not in members:
        return False, None  # an evaluator: it trains nothing in sync
    if dist.is_initialized():  # a second strategy in this task: the device the first one set
        return dist.get_world_size() > 1, torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else None
    local = spec.index_on_host(me, members)  # more tasks than GPUs on a host share them round-robin
    device = torch.device("cuda", local % max(1, torch.cuda.device_count())) if kind == "cuda" else None
    if device is not None:
        torch.cuda.set_device(device)  # before the group: nccl's communicator and barriers use this GPU
    rank = members.index(me)
    host, port = spec.task_address(*members[0]).rsplit(":", 1)
    store = _store(host, int(port), rank == 0, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=len(members),
                            timeout=datetime.timedelta(seconds=timeout_s), device_id=device)
    return len(members) > 1, device


def _store(host: str, port: int, is_host: bool, timeout_s: float) -> dist.TCPStore:
    if is_host:
        from launcher.launch.rendezvous import listening_store  # binds the named host only

        return listening_store(host, port, timeout_s)
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class MultiWorkerMirroredStrategy(Strategy):
    """Mirrors the model on every replica of every worker; gradients are averaged synchronously.

    Args:
        cluster_resolver: where the workers are; default from TF_CONFIG or the launcher's environment.
        communication_options: ``CommunicationOptions`` (implementation, timeout).
        cross_device_ops: how the workers' values are combined (an addition to TF's
            signature): as for ``MirroredStrategy``; None is shared memory between CPU
            processes of one machine, else the plain all-reduce.
    """

    def __init__(self, cluster_resolver: Any = None, communication_options: CommunicationOptions | None = None, *,
                 cross_device_ops: cdo.CrossDeviceOps | None = None, ddp_options: dict | None = None,
                 device_type: str | None = None):
        cdo.resolve(cross_device_ops)  # a TypeError now for anything but None or an op
        options = communication_options or CommunicationOptions()
        resolver = cluster_resolver if cluster_resolver is not None else default_resolver()
        timeout_s = options.timeout_seconds or 300.0
        elastic_env = resolver.env if isinstance(resolver, TorchElasticClusterResolver) else WorkerEnv.from_environ()
        kind = device_type or (elastic_env.device_type if elastic_env else None) or (
            "cuda" if devlib.default_local_devices()[0].startswith("cuda") else "cpu")  # the launcher's choice, else auto
        grouped, task_device = False, None
        if resolver is not None:
            validate_task(resolver)
            backend = _backend(options, kind)
            if isinstance(resolver, TorchElasticClusterResolver):
                grouped = ensure_process_group(resolver.env, backend, timeout_s, kind)
            elif resolver.cluster_spec():
                grouped, task_device = _join_tf_config_group(resolver, backend, timeout_s, kind)
        if grouped:
            env = resolver.env if isinstance(resolver, TorchElasticClusterResolver) else None
            device = devlib.canonical_name(task_device or process_device(env, kind))
            processes = ProcessCollectives()
            ops = cdo.for_processes(cross_device_ops, processes, env, devlib.to_torch(device))
            extended = _MirroredExtended([device], processes, ddp_options, ops)
        else:
            local = devlib.default_local_devices() if kind == "cuda" else ["cpu:0"]
            extended = _MirroredExtended(local, None, ddp_options, cdo.resolve(cross_device_ops))
        super().__init__(extended, cluster_resolver=resolver)


def from_spec(spec: Any, runtime: Runtime) -> MultiWorkerMirroredStrategy:
    resolver = TorchElasticClusterResolver(runtime.env, runtime.device_type) if runtime.env is not None else None
    options = CommunicationOptions(timeout_seconds=runtime.collective_timeout_s)
    return MultiWorkerMirroredStrategy(
        resolver, options, cross_device_ops=cdo.from_name(spec.cross_device_ops),
        ddp_options=spec.ddp_options(), device_type=runtime.device_type,
    )
