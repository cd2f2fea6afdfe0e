"""``MeshStrategy``: replicas of several logical devices each, on a DeviceMesh, with DTensor placements.

The TPUStrategy counterpart of model parallelism inside a replica. A
``DeviceAssignment`` gives ``num_replicas`` replicas of ``num_cores_per_replica``
logical devices; every device is one process, and the job's processes form a
2-D ``DeviceMesh`` named ``("replica", "logical")``. Training is synchronous:
each replica reads its share of every global batch (a replica's logical devices
read the same rows), and gradients are averaged over the replica dimension; or,
with ``data_parallel=ShardedReplicas()``, the replicas shard the model with FSDP2
(``launcher.strategies.impl.mesh_fsdp``: FSDP x tensor parallelism).

Inside a replica, tensors are annotated as TPUStrategy does, with DTensor
placements over the replica's logical devices:

* ``experimental_assign_to_logical_device(t, i)``: the value logical device ``i``
  computed, on every logical device (``Replicate``);
* ``experimental_split_to_logical_devices(t, [1, 2, 4, 1])``: split 2-way along
  dim 1 and 4-way along dim 2 (``Shard`` on a mesh of the split sizes);
* ``experimental_replicate_to_logical_devices(t)``: the whole value everywhere.

Layers are split with torch's tensor parallelism over ``strategy.logical_mesh``
(``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``), as the
``tp_mlp`` recipe does::

    assignment = DeviceAssignment.build(Topology.from_devices(4), computation_shape=[1, 1, 1, 2], num_replicas=2)
    strategy = MeshStrategy(assignment)
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from launcher.cluster.env import WorkerEnv
from launcher.cluster.process_group import ensure_process_group, process_device
from launcher.cluster.resolvers import of_launched_job
from launcher.distribute import devices as devlib
from launcher.distribute.collectives import ProcessCollectives
from launcher.distribute.device_assignment import DeviceAssignment, Topology
from launcher.distribute.dtensors import whole
from launcher.distribute.extended import StrategyExtended
from launcher.distribute.reduce_op import ReduceOp
from launcher.distribute.strategy import Strategy
from launcher.distribute.values import map_structure
from launcher.strategies import Runtime
from launcher.strategies.impl.fsdp import param_dtype
from launcher.strategies.impl.mesh_optimizer import MeshOptimizer
from launcher.strategies.impl.mesh_fsdp import ShardedReplicas


class _AssignedTo(torch.autograd.Function):
    """Forward: every logical device takes device ``src``'s value. Backward: ``src`` gets the sum of their gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, src: int, group: Any, is_src: bool) -> torch.Tensor:
        ctx.group, ctx.is_src = group, is_src
        out = tensor.detach().clone().contiguous()
        dist.broadcast(out, src=src, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        total = grad.detach().clone().contiguous()
        dist.all_reduce(total, group=ctx.group)
        return (total if ctx.is_src else torch.zeros_like(total)), None, None, None


class _MeshExtended(StrategyExtended):
    collective_forward = True

    def __init__(self, device: str, collectives: Any, mesh: DeviceMesh | None, assignment: DeviceAssignment,
                 data_parallel: ShardedReplicas | None = None):
        super().__init__([device], collectives)
        self.mesh, self.assignment, self.data_parallel = mesh, assignment, data_parallel
        self._annotation_mesh: DeviceMesh | None = None

    def _reduce(self, reduce_op: ReduceOp, value: Any, axis: int | None) -> Any:
        return super()._reduce(reduce_op, map_structure(whole, value), axis)

    def _prepare(self, module: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        _say_if_nothing_is_split(module, self.assignment.num_cores_per_replica)
        if self.data_parallel is not None:  # FSDP's reduce-scatter averages over the replicas: no MeshOptimizer
            return self.data_parallel.prepare(module, optimizer, self.mesh)
        if optimizer is None:
            return module, None
        group = self.mesh.get_group("replica") if self.mesh is not None else None
        return module, MeshOptimizer(optimizer, group, self.assignment.num_replicas)

    @property
    def _reads_input(self) -> bool:
        # Logical device 0 of each replica reads the replica's input; the others receive it.
        return self.mesh is None or self.assignment.num_cores_per_replica == 1 or self._logical_id() == 0

    def _input_agreement(self) -> Any:
        # Only a replica's logical device 0 reads (the others wait in _share_input): each replica ends on its own.
        if self.mesh is not None and self.assignment.num_cores_per_replica > 1:
            return None
        return super()._input_agreement()

    def _share_input(self, steps: Iterator[list[Any]]) -> Iterator[list[Any]]:
        if self.mesh is None or self.assignment.num_cores_per_replica == 1:
            return steps
        replica = self.assignment.position(dist.get_rank())[0]
        src = self.assignment.rank(replica, 0)
        return _broadcast_steps(steps if self._reads_input else None, self._input_group(), src)

    def _input_group(self) -> Any:
        """The replica's logical devices as a gloo group, made once (every rank makes every replica's, in order):
        under nccl, a broadcast of the next step's input would wait on the GPU's queue (the current step) and
        read its size back on the host, so input could never be read while the GPU computes."""
        if self.__dict__.get("_gloo_inputs") is None:  # once: every pass over the data (an epoch, a seek) uses it
            a = self.assignment
            ranks = [[a.rank(r, i) for i in range(a.num_cores_per_replica)] for r in range(a.num_replicas)]
            self._gloo_inputs = dist.new_subgroups_by_enumeration(ranks, backend="gloo")[0]
        return self._gloo_inputs

    def _logical_id(self) -> int:
        return self.assignment.position(dist.get_rank())[1]

    @property
    def annotation_sizes(self) -> tuple[int, ...]:
        """The annotation mesh's shape: ``computation_shape``'s dims, each cut into its prime factors."""
        return tuple(p for size in self.assignment.computation_shape for p in _prime_factors(size))

    def annotation_mesh(self) -> DeviceMesh:
        """This replica's logical devices as the one mesh every annotation lives on.

        One mesh, so that split, assigned and replicated tensors combine in any
        arithmetic (DTensor refuses operands on different meshes). Its dims are
        ``computation_shape``'s cut into primes, so that any ``partition_dimensions``
        whose product is the number of logical devices is a set of its dims. With a
        prime number of logical devices it is ``logical_mesh`` itself, the mesh
        tensor parallelism splits layers over. Built on first use, by every process
        in the same order (creating a mesh is collective).
        """
        if self._annotation_mesh is None:
            sizes = self.annotation_sizes
            if len(sizes) <= 1:
                self._annotation_mesh = self.mesh["logical"]
            else:
                replicas = self.assignment.num_replicas
                ranks = torch.arange(replicas * math.prod(sizes)).reshape(replicas, *sizes)
                names = ("replica", *(f"core{i}" for i in range(len(sizes))))
                self._annotation_mesh = DeviceMesh(self.mesh.device_type, ranks, mesh_dim_names=names)[names[1:]]
        return self._annotation_mesh


class _EndOfInput:
    """Logical device 0's word that the replica's input is over."""


class _InputFailed:
    def __init__(self, error: BaseException):
        self.error = error


def _say_if_nothing_is_split(module: torch.nn.Module, logical: int) -> None:
    """A model of whole parameters over several logical devices (no ``parallelize_module`` in its build): each logical
    device holds all of it, and unless its forward splits activations, computes the same as the others. Said once,
    by rank 0."""
    if logical == 1 or any(isinstance(p, DTensor) for p in module.parameters()) or dist.get_rank() != 0:
        return
    logging.getLogger("dlaunch").warning(
        "mesh: no parameter of the model is split over the %d logical devices of a replica (nothing applied "
        "parallelize_module to it: a recipe's build, or a script before strategy.prepare), so each holds the whole model, and unless its forward splits activations "
        "(experimental_split_to_logical_devices) each computes what the others do; strategy=mirrored on the same "
        "devices trains %d replicas instead (docs/STRATEGIES.md)", logical, dist.get_world_size())


def _broadcast_steps(steps: Iterator[list[Any]] | None, group: Any, src: int) -> Iterator[list[Any]]:
    """Each step read by ``src`` (logical device 0), sent to the replica's other logical devices.

    Reading once and sending keeps a replica's devices on the same values even
    when the input is random or changes between reads. An error while reading is
    raised on every device of the replica, not only on the reader.
    """
    source = iter(steps) if steps is not None else None
    while True:
        box: list[Any] = [None]
        if source is not None:
            try:
                box[0] = next(source, _EndOfInput)
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every logical device
                box[0] = _InputFailed(exc)
        dist.broadcast_object_list(box, src=src, group=group)
        if box[0] is _EndOfInput:  # a class pickles by reference: the same object here
            return
        if isinstance(box[0], _InputFailed):
            raise box[0].error
        yield box[0]


class MeshStrategy(Strategy):
    """Synchronous replicas of several logical devices each (TPUStrategy's device assignment) on DeviceMesh/DTensor.

    Args:
        device_assignment: replicas x logical devices; default: one logical device per
            process (plain data parallelism).
        data_parallel: ``ShardedReplicas(...)`` shards the replica dim with FSDP2
            (``launcher.strategies.impl.mesh_fsdp``); default: each replica a whole copy.
        device_type: "cpu" or "cuda"; default: CUDA when visible.
        timeout_s: collective timeout.

    Processes come from the launcher (dlaunch or torchrun): rank ``r * L + l`` is logical
    device ``l`` of replica ``r``.
    """

    def __init__(self, device_assignment: DeviceAssignment | None = None, *, data_parallel: ShardedReplicas | None = None,
                 device_type: str | None = None, timeout_s: float = 300.0, env: WorkerEnv | None = None):
        env = env if env is not None else WorkerEnv.from_environ()
        kind = device_type or (env.device_type if env else None) or ("cuda" if devlib.default_local_devices()[0].startswith("cuda") else "cpu")
        grouped = ensure_process_group(env, None, timeout_s, kind)
        world = dist.get_world_size() if grouped else 1
        assignment = device_assignment or DeviceAssignment.build(Topology.from_devices(world), [1], num_replicas=world)
        needed = assignment.num_replicas * assignment.num_cores_per_replica
        if needed != world:
            raise ValueError(f"computation_shape {assignment.computation_shape} x num_replicas {assignment.num_replicas} = "
                             f"{needed} devices, but the job has {world} process(es)")
        mesh = None
        if grouped:
            mesh = init_device_mesh(kind, (assignment.num_replicas, assignment.num_cores_per_replica),
                                    mesh_dim_names=("replica", "logical"))
        device = devlib.canonical_name(process_device(env, kind)) if grouped else ("cuda:0" if kind == "cuda" else "cpu:0")
        collectives = ProcessCollectives(mesh.get_group("replica")) if mesh is not None and assignment.num_replicas > 1 else None
        resolver = of_launched_job(env, kind) if grouped else None
        super().__init__(_MeshExtended(device, collectives, mesh, assignment, data_parallel), cluster_resolver=resolver)

    # ----- the device assignment -----
    @property
    def device_assignment(self) -> DeviceAssignment:
        return self._extended.assignment

    @property
    def num_logical_devices(self) -> int:
        """Logical devices per replica."""
        return self._extended.assignment.num_cores_per_replica

    @property
    def mesh(self) -> DeviceMesh | None:
        """The 2-D ``("replica", "logical")`` DeviceMesh (None in one process)."""
        return self._extended.mesh

    @property
    def logical_mesh(self) -> DeviceMesh | None:
        """This replica's logical devices: the 1-D mesh that tensor parallelism splits layers over."""
        return None if self.mesh is None else self.mesh["logical"]

    @property
    def logical_device_id(self) -> int:
        """Which logical device of its replica this process is."""
        rank = dist.get_rank() if self.mesh is not None else 0
        return self._extended.assignment.position(rank)[1]

    # ----- the annotations -----
    @property
    def annotation_mesh(self) -> DeviceMesh | None:
        """The one mesh of this replica's logical devices that every annotated tensor lives on (None in one process)."""
        return None if self.mesh is None else self._extended.annotation_mesh()

    def experimental_assign_to_logical_device(self, tensor: torch.Tensor, logical_device_id: int) -> torch.Tensor:
        """Adds annotation that ``tensor`` will be assigned to a logical device.

        The value logical device ``logical_device_id`` computed, on every logical
        device of the replica (a replicated DTensor on ``annotation_mesh``); its
        gradient flows back to that device alone::

            output = strategy.experimental_assign_to_logical_device(features + features, 0)

        Raises ``ValueError`` when the id is not one of the replica's logical devices.
        """
        n = self.num_logical_devices
        if not isinstance(logical_device_id, int) or not 0 <= logical_device_id < n:
            raise ValueError("The logical device id presented is not consistent with total number of partitions specified "
                             f"by the device assignment. (logical device id {logical_device_id} is out of range: the device "
                             f"assignment gives each replica {n} logical device(s), ids 0..{n - 1})")
        if self.mesh is None or n == 1:
            return tensor
        group = self.mesh.get_group("logical")
        replica = self._extended.assignment.position(dist.get_rank())[0]
        src = self._extended.assignment.rank(replica, logical_device_id)
        value = _AssignedTo.apply(whole(tensor), src, group, dist.get_rank() == src)
        return self._replicated(value)

    def experimental_split_to_logical_devices(self, tensor: torch.Tensor, partition_dimensions: Sequence[int]) -> torch.Tensor:
        """Adds annotation that ``tensor`` will be split across logical devices.

        ``partition_dimensions[d]``-way along each dim ``d``; with 8 logical devices,
        ``[1, 2, 4, 1]`` splits an image batch 2-way in width and 4-way in height.
        The result is a DTensor sharded over ``annotation_mesh``. ``ValueError`` (the
        seed's three cases): a length other than the tensor's rank, a product other
        than the number of logical devices, a size not divisible by its partition.
        """
        dims = [int(d) for d in partition_dimensions]
        _check_split(tuple(tensor.shape), dims, self.num_logical_devices)
        if self.mesh is None or self.num_logical_devices == 1:
            return tensor
        mesh = self._extended.annotation_mesh()
        placements = _split_placements(dims, self._extended.annotation_sizes)
        local = whole(tensor)
        for size, coordinate, placement in zip(mesh.shape, mesh.get_coordinate(), placements):
            if isinstance(placement, Shard):  # nested, in mesh-dim order, as DTensor lays out repeated shards
                local = local.tensor_split(size, dim=placement.dim)[coordinate]
        return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False,
                                  shape=tensor.shape, stride=torch.empty(tensor.shape).stride())

    def experimental_replicate_to_logical_devices(self, tensor: torch.Tensor) -> torch.Tensor:
        """Adds annotation that ``tensor`` will be replicated to all logical devices.

        The whole value on every logical device: a split tensor is gathered, and a
        DTensor on another mesh (a tensor-parallel layer's output) is brought onto
        ``annotation_mesh``, so that labels and logits combine in the loss.
        """
        if self.mesh is None or self.num_logical_devices == 1:
            return tensor
        mesh = self._extended.annotation_mesh()
        if isinstance(tensor, DTensor) and tensor.device_mesh == mesh:
            return tensor.redistribute(mesh, [Replicate()] * mesh.ndim)
        return self._replicated(whole(tensor))

    def _replicated(self, value: torch.Tensor) -> DTensor:
        mesh = self._extended.annotation_mesh()
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def _split_placements(dims: list[int], sizes: tuple[int, ...]) -> list[Any]:
    """Per annotation-mesh dim: which tensor dim it splits (``Shard``), or ``Replicate``.

    Each partition is made of mesh dims of its prime factors, taken in order, so
    that blocks go to logical devices in row-major order where the shapes allow it.
    """
    free, placements = list(range(len(sizes))), [Replicate()] * len(sizes)
    for d, parts in enumerate(dims):
        for p in _prime_factors(parts):
            i = next(i for i in free if sizes[i] == p)  # the products agree (_check_split), so one is free
            free.remove(i)
            placements[i] = Shard(d)
    return placements


def _check_split(shape: tuple[int, ...], dims: list[int], logical: int) -> None:
    """The seed's three ValueErrors, in its order."""
    if len(dims) != len(shape):
        raise ValueError(f"partition_dimensions {dims} has {len(dims)} entries, but the tensor has rank {len(shape)} "
                         f"(shape {list(shape)}): give one entry per dimension")
    if math.prod(dims) != logical:
        raise ValueError(f"the product of partition_dimensions {dims} is {math.prod(dims)}, but each replica has "
                         f"{logical} logical device(s)")
    for d, (size, parts) in enumerate(zip(shape, dims)):
        if parts < 1 or size % parts:
            raise ValueError(f"dimension {d} of the tensor (size {size}) is not divisible by its partition {parts} "
                             f"(shape {list(shape)}, partition_dimensions {dims})")


def from_spec(spec: Any, runtime: Runtime) -> MeshStrategy:
    cluster = runtime.run_spec.cluster
    assignment = DeviceAssignment.build(Topology.from_devices(cluster.world_size), spec.device_assignment.computation_shape,
                                        num_replicas=spec.replicas(cluster))
    return MeshStrategy(assignment, data_parallel=_data_parallel(spec, runtime), device_type=runtime.device_type,
                        timeout_s=runtime.collective_timeout_s, env=runtime.env)


def _data_parallel(spec: Any, runtime: Runtime) -> ShardedReplicas | None:
    if spec.data_parallel != "fsdp":
        return None
    return ShardedReplicas(spec.fsdp.reshard_after_forward, spec.fsdp.wrap, param_dtype(runtime))
