"""Cross-device ops: how per-replica values are combined, as ``tf.distribute.CrossDeviceOps``.

Select one with ``MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce())``,
or in a config with ``strategy.cross_device_ops=hierarchical_copy``. Each op is
a torch mechanism at two levels:

* **Between processes** (one replica per process): gradients go through DDP;
  an op whose process step is not the plain all-reduce becomes a DDP
  communication hook (``register_comm_hook``) that reduces each gradient bucket
  its way. ``strategy.reduce`` and ``extended.reduce_to`` take the same step.
* **Between the thread replicas of one process** (``devices=["cpu:0", "cpu:1"]``):
  the op decides on which device the values are summed and which replica
  thread does the work; the result is copied back to every replica.

``None`` (the base class): ``dist.all_reduce``, DDP's own; thread replicas share
the sums. ``NcclAllReduce``: the same between processes (nccl on CUDA, gloo on
CPU); ``torch.cuda.nccl.all_reduce`` between CUDA thread replicas.
``HierarchicalCopyAllReduce`` (``hierarchical.py``): reduce to each node's leader,
all-reduce among leaders, broadcast within the node, in subgroups. ``SharedMemoryAllReduce``
(``shared_memory.py``): one machine's CPU processes through ``/dev/shm``. ``ReductionToOneDevice``:
``dist.reduce`` to one rank, then ``dist.broadcast``. All give the same numbers
(up to the order of floating-point additions).

Example::

    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"], cross_device_ops=ReductionToOneDevice())
    v = PerReplica([torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])])
    strategy.extended.reduce_to(ReduceOp.SUM, v, destinations="cpu:0")   # tensor([ 4,  6,  8, 10])
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from launcher.distribute import devices as devlib
from launcher.distribute.collectives import ProcessCollectives, SingleProcess
from launcher.distribute.reduce_op import ReduceOp
from launcher.distribute.values import PerReplica



class CrossDeviceOps:
    """Base class for cross-device reduction and broadcasting algorithms.

    The base class itself is the default that ``cross_device_ops=None`` selects:
    a plain all-reduce between processes (DDP's own), and between thread
    replicas a sum that the replicas share (each one reduces every n-th tensor).
    Subclasses change one level or both by overriding ``_local_sum``,
    ``_thread_owner`` or ``_all_reduce_sum_``.
    """

    name: str | None = None  # the config name; None for the default
    num_packs = 0  # batch_reduce packs values into this many buffers per dtype; 0: one collective per value

    # ----- tf.distribute.CrossDeviceOps -----
    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any = None) -> Any:
        """Reduce ``per_replica_value`` (a ``PerReplica`` or a tensor) to ``destinations``.

        Across processes when this process is one of several in the default
        process group. ``destinations`` is a device name, a tensor (its device),
        a list of devices or a ``PerReplica`` (one result per component), or
        None (where the sum was made).
        """
        return self._reduce(ReduceOp.from_any(reduce_op), per_replica_value, destinations, _default_processes())

    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]) -> list:
        """Reduce several values at once; packed into ``num_packs`` buffers per dtype between processes."""
        return self._batch_reduce(ReduceOp.from_any(reduce_op), list(value_destination_pairs), _default_processes())

    def broadcast(self, tensor: torch.Tensor, destinations: Any) -> Any:
        """A copy of ``tensor`` on each of ``destinations`` (one device: a tensor, several: a ``PerReplica``)."""
        return place(torch.as_tensor(tensor), destinations, copy=True)

    # ----- used by strategies, with their process level -----
    def _reduce(self, op: ReduceOp, value: Any, destinations: Any, processes: Any) -> Any:
        return self._batch_reduce(op, [(value, destinations)], processes)[0]

    def _batch_reduce(self, op: ReduceOp, pairs: list[tuple[Any, Any]], processes: Any) -> list:
        components = [_components(value) for value, _ in pairs]
        # Every total is a new tensor: the local sum's, or the process step's buffer (one copy, not two).
        sums = [parts[0] if len(parts) == 1 and processes.world_size > 1 else self._local_sum(parts) for parts in components]
        totals = self._process_sums(sums, processes)
        out = []
        for parts, total, (_, destinations) in zip(components, totals, pairs):
            if op is ReduceOp.MEAN:
                # Across processes the total is the process step's own buffer.
                total = divide_new(total, len(parts) * processes.world_size, owned=processes.world_size > 1)
            out.append(place(total, destinations))
        return out

    def _local_sum(self, parts: Sequence[Any]) -> torch.Tensor:
        """The sum of this process's per-replica values (a new tensor), on the first one's device."""
        tensors = [torch.as_tensor(p) for p in parts]
        return _add_n([t.to(tensors[0].device) for t in tensors])

    def _process_sum(self, tensor: torch.Tensor, processes: Any) -> torch.Tensor:
        """The sum over processes of every process's ``tensor``."""
        if processes.world_size == 1:
            return tensor
        buffer = processes.comm_buffer(tensor)
        self._all_reduce_sum_(buffer, processes.group)
        return buffer.to(tensor.device)

    def _check_same_shape(self, tensor: torch.Tensor, processes: Any) -> None:
        """Every process reduces a value of this shape (else an error, not a crash or a hang)."""
        processes.check_same_shape(tensor)

    def _process_sums(self, tensors: list[torch.Tensor], processes: Any) -> list[torch.Tensor]:
        if processes.world_size == 1:
            return tensors
        if self.num_packs <= 0:
            return [self._process_sum(t, processes) for t in tensors]
        return _packed(tensors, self.num_packs, lambda chunk: self._process_sum(chunk, processes))

    def _all_reduce_sum_(self, buffer: torch.Tensor, group: Any) -> None:
        """In place: every process's ``buffer`` becomes the sum over ``group``."""
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)

    # ----- thread replicas of one process (gradients of mirrored copies) -----
    def _thread_owner(self, index: int, copies: Sequence[torch.Tensor | None]) -> int:
        """Which local replica reduces the ``index``-th tensor: shared round-robin by default."""
        return index % len(copies)

    def _all_reduce_copies_(self, copies: list[torch.Tensor], divisor: int) -> None:
        """In place: every copy becomes the sum of the copies divided by ``divisor``."""
        total = self._local_sum(copies) / divisor
        for c in copies:
            c.copy_(total, non_blocking=True)

    # ----- DDP -----
    def _ddp_comm_hook(self) -> Callable | None:
        """A hook for ``DistributedDataParallel.register_comm_hook``; None where DDP's own all-reduce is the op."""
        if type(self)._all_reduce_sum_ is CrossDeviceOps._all_reduce_sum_:
            return None
        return self._reduce_bucket

    def _reduce_bucket(self, state, bucket):  # no annotations: DDP compares them with real types
        """Average one gradient bucket with this op's process step.

        The collectives run in order before the hook returns: unlike DDP's own
        all-reduce they do not overlap with the rest of backward, and every rank
        issues them in the same (bucket) order.
        """
        buffer = bucket.buffer()
        self._mean_(buffer, state)
        future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        future.set_result(buffer)
        return future

    def _mean_(self, buffer: torch.Tensor, group: Any) -> None:
        """In place: ``buffer`` becomes the mean over ``group`` (divided first, as DDP's own hook does)."""
        buffer.div_(dist.get_world_size(group))
        self._all_reduce_sum_(buffer, group)

    def _join(self, processes: ProcessCollectives, env: Any) -> None:
        """Called by a strategy once it is in a process group; builds what the op needs collectively."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NcclAllReduce(CrossDeviceOps):
    """Reduction using an NCCL all-reduce: the plain all-reduce over the process group.

    Between processes the backend of the process group runs it: nccl on CUDA,
    gloo on CPU (same numbers, so the name is kept for TF code). Between the
    CUDA thread replicas of one process it is ``torch.cuda.nccl.all_reduce``,
    driven by replica 0's thread; on CPU replicas it is the default.

    Args:
        num_packs: ``batch_reduce`` concatenates values of one dtype and splits them
            into this many buffers, one collective each (0: one collective per value).
    """

    name = "nccl_all_reduce"

    def __init__(self, num_packs: int = 1):
        self.num_packs = non_negative("num_packs", num_packs)

    def _local_sum(self, parts: Sequence[Any]) -> torch.Tensor:
        tensors = [torch.as_tensor(p) for p in parts]
        if _nccl_ready(tensors):
            return torch.cuda.comm.reduce_add(tensors, destination=tensors[0].device.index)
        return super()._local_sum(tensors)

    def _thread_owner(self, index: int, copies: Sequence[torch.Tensor | None]) -> int:
        # One thread issues every NCCL call: concurrent calls on one communicator can deadlock.
        return 0 if _nccl_ready([c for c in copies if c is not None]) else super()._thread_owner(index, copies)

    def _all_reduce_copies_(self, copies: list[torch.Tensor], divisor: int) -> None:
        if not _nccl_ready(copies):
            return super()._all_reduce_copies_(copies, divisor)
        torch.cuda.nccl.all_reduce(copies)
        for c in copies:
            c.div_(divisor)

    def __repr__(self) -> str:
        return f"NcclAllReduce(num_packs={self.num_packs})"


class ReductionToOneDevice(CrossDeviceOps):
    """Always do reduction to one device first and then do broadcasting.

    Between processes: ``dist.reduce`` onto ``root_rank``, then ``dist.broadcast``
    from it (a DDP communication hook for gradients). Between thread replicas:
    ``accumulation_fn`` sums the values on ``reduce_to_device`` on replica 0's
    thread, and the result is copied back to every replica.

    Args:
        reduce_to_device: where thread replicas' values are summed, e.g. ``"cuda:0"``;
            default the first replica's device.
        accumulation_fn: ``fn(list_of_tensors) -> tensor``; default adds them in replica order.
        root_rank: the process that receives the reduction across processes.
    """

    name = "reduction_to_one_device"

    def __init__(self, reduce_to_device: str | None = None, accumulation_fn: Callable | None = None, *, root_rank: int = 0):
        self.reduce_to_device = None if reduce_to_device is None else devlib.canonical_name(reduce_to_device)
        self.accumulation_fn = accumulation_fn or _add_n
        self.root_rank = non_negative("root_rank", root_rank)

    def _local_sum(self, parts: Sequence[Any]) -> torch.Tensor:
        tensors = [torch.as_tensor(p) for p in parts]
        device = devlib.to_torch(self.reduce_to_device) if self.reduce_to_device else tensors[0].device
        return self.accumulation_fn([t.to(device) for t in tensors])

    def _thread_owner(self, index: int, copies: Sequence[torch.Tensor | None]) -> int:
        return 0

    def _all_reduce_sum_(self, buffer: torch.Tensor, group: Any) -> None:
        size = dist.get_world_size(group)
        if self.root_rank >= size:
            raise ValueError(f"ReductionToOneDevice(root_rank={self.root_rank}) needs more than {size} processes")
        dist.reduce(buffer, group_dst=self.root_rank, op=dist.ReduceOp.SUM, group=group)
        dist.broadcast(buffer, group_src=self.root_rank, group=group)

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r}, root_rank={self.root_rank})"


def _by_name() -> dict[str, type[CrossDeviceOps]]:
    # the hierarchical and shared-memory ops subclass CrossDeviceOps in their own modules
    from launcher.distribute.hierarchical import HierarchicalCopyAllReduce
    from launcher.distribute.shared_memory import SharedMemoryAllReduce

    return {cls.name: cls for cls in (NcclAllReduce, HierarchicalCopyAllReduce, ReductionToOneDevice, SharedMemoryAllReduce)}


def from_name(name: str | None) -> CrossDeviceOps | None:
    """The op a config names (``strategy.cross_device_ops``), with its defaults; None stays None."""
    if name is None:
        return None
    ops = _by_name()
    try:
        return ops[name]()
    except KeyError:
        raise ValueError(f"unknown cross_device_ops {name!r}; allowed: {', '.join(ops)}") from None


def for_processes(ops: CrossDeviceOps | None, processes: ProcessCollectives, env: Any, device: torch.device) -> CrossDeviceOps:
    """The op of a strategy with one replica per process, joined to its group (collective).

    The given op, or for None the fastest default: shared memory when every
    process computes on this machine's CPU, else the backend's all-reduce.
    """
    if ops is None and device.type == "cpu":
        from launcher.distribute.shared_memory import SharedMemoryAllReduce

        shared = SharedMemoryAllReduce(required=False)
        shared._join(processes, env)
        if shared.active(processes.group):
            return shared
    ops = resolve(ops)
    ops._join(processes, env)
    return ops


def resolve(ops: CrossDeviceOps | None) -> CrossDeviceOps:
    """The op a strategy uses: the given one, or the default all-reduce for None."""
    if ops is None:
        return CrossDeviceOps()
    if not isinstance(ops, CrossDeviceOps):
        raise TypeError(
            f"cross_device_ops must be None or a CrossDeviceOps such as NcclAllReduce(), "
            f"HierarchicalCopyAllReduce() or ReductionToOneDevice(); got {ops!r}"
        )
    return ops


def place(tensor: torch.Tensor, destinations: Any, copy: bool = False) -> Any:
    """``tensor`` on ``destinations``: one device gives a tensor, several a ``PerReplica``."""
    if destinations is None:
        return tensor.clone() if copy else tensor
    if isinstance(destinations, PerReplica):
        destinations = destinations.values
    if isinstance(destinations, (list, tuple)):
        return PerReplica([tensor.to(_device_of(d), copy=True) for d in destinations])
    return tensor.to(_device_of(destinations), copy=copy)


def _device_of(destination: Any) -> torch.device:
    if isinstance(destination, torch.Tensor):
        return destination.device
    if isinstance(destination, torch.device):
        return destination
    return devlib.to_torch(destination)


def divide_new(total: torch.Tensor, count: int, owned: bool) -> torch.Tensor:
    """``total / count``; in place (no second buffer) when ``total`` is a floating tensor nobody else holds."""
    if owned and (total.is_floating_point() or total.is_complex()):
        return total.div_(count)
    return total / count


def _components(value: Any) -> list[torch.Tensor]:
    values = value.values if isinstance(value, PerReplica) else (value,)
    return [torch.as_tensor(v) for v in values]


def _add_n(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Add in order into a new tensor (the same additions, so the same bits, as a plain sum)."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total = total + t
    return total


def _packed(tensors: list[torch.Tensor], num_packs: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Reduce ``tensors`` as ``num_packs`` flat buffers per (dtype, device) instead of one by one."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    kinds: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.dtype, t.device), []).append(i)
    for indices in kinds.values():
        if len(indices) == 1 and num_packs == 1:  # one value, one pack: nothing to concatenate or split
            out[indices[0]] = reduce(tensors[indices[0]])
            continue
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        for chunk in flat.tensor_split(max(1, min(num_packs, flat.numel()))):
            chunk.copy_(reduce(chunk))
        for i, part in zip(indices, flat.split([tensors[i].numel() for i in indices])):
            out[i] = part.view(tensors[i].shape)
    return out  # type: ignore[return-value]


def _nccl_ready(tensors: Sequence[torch.Tensor]) -> bool:
    """Several CUDA tensors on distinct devices that ``torch.cuda.nccl`` can reduce."""
    if len(tensors) < 2 or not all(t.is_cuda for t in tensors):
        return False
    return torch.cuda.nccl.is_available(tensors)


def group_key(group: Any) -> Any:
    """The process group an op runs over: ``group``, or the default (world) group for None."""
    return group if group is not None else dist.group.WORLD


def group_timeout_s(group: Any) -> float:
    """The process group's collective timeout (its gloo backend's), else torch's default."""
    try:
        return group_key(group)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return 1800.0


def _default_processes() -> Any:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ProcessCollectives()
    return SingleProcess()


def non_negative(what: str, value: int) -> int:
    """``value``, checked as a count or a rank (the ops' constructors name the argument)."""
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value
