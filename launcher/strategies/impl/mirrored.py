"""``MirroredStrategy``: synchronous data parallelism, one model copy per replica.

Two modes, one API:

* **In one process** (``MirroredStrategy(devices=["cpu:0", "cpu:1"])``): one
  replica per listed device, run on threads created once. Each replica has its
  own model copy; gradients are averaged across copies before each update.
* **Across processes** (started by ``dlaunch``, or torchrun): one replica per
  process, gradients averaged by DDP's bucketed all-reduce that overlaps with
  backward. ``num_replicas_in_sync`` counts every process. When every process
  computes on the CPU of one machine, the default reduces DDP's buckets through
  shared memory instead of gloo's loopback sockets (``SharedMemoryAllReduce``).

``cross_device_ops`` picks how values are combined in either mode
(``launcher/distribute/cross_device_ops.py``): across processes a
``HierarchicalCopyAllReduce`` or ``ReductionToOneDevice`` becomes DDP's
communication hook; between thread replicas it decides where the sum is made.

Example::

    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from launcher.cluster.env import WorkerEnv
from launcher.cluster.process_group import ensure_process_group, process_device
from launcher.cluster.resolvers import of_launched_job
from launcher.distribute import cross_device_ops as cdo
from launcher.distribute import devices as devlib
from launcher.distribute.collectives import ProcessCollectives
from launcher.distribute.extended import StrategyExtended
from launcher.distribute.replicated import MirroredModule, MirroredOptimizer
from launcher.distribute.strategy import Strategy
from launcher.strategies import Runtime


class _MirroredExtended(StrategyExtended):
    def __init__(
        self, devices: Sequence[str], collectives: Any = None, ddp_options: dict | None = None,
        cross_device_ops: cdo.CrossDeviceOps | None = None,
    ):
        super().__init__(devices, collectives, cross_device_ops=cross_device_ops)
        self._ddp_options = dict(ddp_options or {})
        self._copies: weakref.WeakSet = weakref.WeakSet()  # mirrored modules and optimizers to resync

    def _call_for_each_replica(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return super()._call_for_each_replica(fn, args, kwargs)
        except BaseException:
            # Some replicas may have stepped before another failed: realign on replica 0.
            for copies in list(self._copies):
                copies.resync()
            raise

    def _local_results(self, value: Any) -> tuple:
        """A parameter of a prepared model: every local replica's copy, as TF's MirroredVariable components."""
        if isinstance(value, torch.Tensor):
            for copies in list(self._copies):
                found = copies.local_copies(value) if isinstance(copies, MirroredModule) else None
                if found is not None:
                    return found
        return super()._local_results(value)

    def _prepare(self, module: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        if self._proc.world_size > 1:
            return self._wrap_ddp(module), optimizer
        if self._num_local == 1:
            return module.to(self._devices[0]), optimizer
        mirrored = MirroredModule(module, self._devices, self._container, self._rendezvous, self._cross_device_ops)
        self._copies.add(mirrored)
        if optimizer is None:
            return mirrored, None
        optimizer = MirroredOptimizer(optimizer, mirrored)
        self._copies.add(optimizer)
        return mirrored, optimizer

    def _wrap_ddp(self, module: torch.nn.Module) -> DistributedDataParallel:
        device = self._devices[0]
        module = module.to(device)
        ddp = DistributedDataParallel(
            module,
            device_ids=[device.index] if device.type == "cuda" else None,
            **self._ddp_options,
        )
        hook = self._cross_device_ops._ddp_comm_hook()
        if hook is not None:  # None: DDP's own all-reduce is the op
            ddp.register_comm_hook(ddp.process_group, hook)
        return ddp


class MirroredStrategy(Strategy):
    """Mirrors the model on every replica and averages gradients synchronously.

    Args:
        devices: replica devices for one process, e.g. ``["cpu:0", "cpu:1"]`` or
            ``["GPU:0", "GPU:1"]``. Default: every visible GPU, else the CPU. When
            this process is one of several workers, the default is this
            process's device and only one device may be given.
        cross_device_ops: how replicas' values are combined: ``NcclAllReduce()``,
            ``HierarchicalCopyAllReduce()``, ``ReductionToOneDevice()``,
            ``SharedMemoryAllReduce()``, or None for the default: across CPU processes
            of one machine, shared memory; otherwise the backend's all-reduce (DDP's own).
        ddp_options: keyword arguments for ``DistributedDataParallel`` across processes
            (``bucket_cap_mb``, ``gradient_as_bucket_view``, ``find_unused_parameters``).
        env: where this process sits in a multi-process job; by default what the
            launcher (dlaunch's workers, torchrun) put in the environment.
    """

    def __init__(
        self, devices: Sequence[str] | None = None, cross_device_ops: Any = None, *,
        ddp_options: dict | None = None, env: WorkerEnv | None | str = "from-environment",
    ):
        cdo.resolve(cross_device_ops)  # a TypeError now for anything but None or an op
        if env == "from-environment":
            env = WorkerEnv.from_environ()
        resolver = None
        if ensure_process_group(env):
            devices = list(devices) if devices is not None else [devlib.canonical_name(process_device(env))]
            if len(devices) != 1:
                raise ValueError(
                    f"with one process per replica each process takes one device; got devices={devices}"
                )
            processes = ProcessCollectives()
            ops = cdo.for_processes(cross_device_ops, processes, env, devlib.to_torch(devices[0]))
            extended = _MirroredExtended(devices, processes, ddp_options, ops)
            resolver = of_launched_job(env, extended._devices[0].type)
        else:
            local = list(devices) if devices else devlib.default_local_devices()
            extended = _MirroredExtended(local, None, ddp_options, cdo.resolve(cross_device_ops))
        super().__init__(extended, cluster_resolver=resolver)


def from_spec(spec: Any, runtime: Runtime) -> MirroredStrategy:
    """One replica per process, on the device type the validated spec resolved.

    The worker joined the process group already (in its preflight): the strategy finds it.
    """
    device = devlib.canonical_name(process_device(runtime.env, runtime.device_type))
    ops = cdo.from_name(spec.cross_device_ops)
    return MirroredStrategy(devices=[device], cross_device_ops=ops, ddp_options=spec.ddp_options(), env=runtime.env)
