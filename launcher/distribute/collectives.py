"""Collectives between replicas: across processes (torch.distributed) and between
local replica threads (a barrier and shared slots).

The strategies compose these two levels: local replicas first, then processes.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from launcher.cluster.process_group import comm_device


def takes_cpu_tensors(group: Any) -> bool:
    """Whether ``group``'s backend communicates CPU tensors (gloo; not nccl alone)."""
    return comm_device(group).type == "cpu"


class SingleProcess:
    """The process level when there is one process: every op is the identity."""

    world_size = 1
    rank = 0

    def check_same_shape(self, tensor: torch.Tensor, all_reduce_max_: Any = None) -> None:
        pass

    def all_reduce_count(self, count: int) -> int:
        return count

    def all_reduce_min(self, value: int) -> int:
        return value

    def sum_rows(self, mine: int) -> int:
        return mine

    def all_gather_cat(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return tensor


class ProcessCollectives:
    """Collectives over a torch.distributed process group (gloo on CPU, nccl on CUDA).

    Sums of values are the cross-device ops' (``cross_device_ops.py``); these are the
    bookkeeping collectives around them (shapes, counts, gathers).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._cpu_group: Any = None

    def comm_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``tensor`` on the device this group's backend communicates from."""
        return tensor.detach().to(comm_device(self.group), copy=True).contiguous()

    def check_same_shape(self, tensor: torch.Tensor, all_reduce_max_: Callable[[torch.Tensor], Any] | None = None) -> None:
        """Every process must reduce the same shape (gloo would crash, nccl would hang).

        One small all-reduce (MAX of the shape and of its negation: equal shapes
        give ``max == -max(-shape)``), by ``all_reduce_max_`` if given.
        """
        shape = [tensor.dim(), *tensor.shape[:8]] + [-1] * (8 - min(tensor.dim(), 8))
        both = torch.tensor(shape + [-d for d in shape], dtype=torch.int64)
        if all_reduce_max_ is not None:
            all_reduce_max_(both)
        else:
            both = both.to(comm_device(self.group))
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        high, low = both[:9], both[9:].neg()
        if not torch.equal(low, high):
            raise ValueError(
                f"per-replica values have different shapes across processes (this one: {list(tensor.shape)}); "
                "pass axis= to reduce along the batch dimension (for example with a last partial batch)"
            )

    def all_reduce_count(self, count: int) -> int:
        t = torch.tensor([count], dtype=torch.int64, device=comm_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return int(t.item())

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the processes (e.g. how many batches every worker still has)."""
        t = torch.tensor([value], dtype=torch.int64, device=comm_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def sum_rows(self, mine: int) -> int:
        """Every process's ``mine`` added up: one SUM all-reduce of a CPU int, on a gloo group of its own where the
        job's backend is nccl (made at the first call, which every process makes): a per-step count never syncs the GPU."""
        if self._cpu_group is None:
            self._cpu_group = self.group if takes_cpu_tensors(self.group) else dist.new_group(backend="gloo")
        count = torch.tensor([int(mine)], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self._cpu_group)
        return int(count.item())

    def all_gather_cat(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        """Concatenate every process's ``tensor`` along ``axis``; sizes along it may differ."""
        home = tensor.device
        tensor = tensor.detach().to(comm_device(self.group)).contiguous()
        axis = axis % max(tensor.dim(), 1)
        sizes = torch.tensor([tensor.shape[axis]], dtype=torch.int64, device=tensor.device)
        all_sizes = [torch.zeros_like(sizes) for _ in range(self.world_size)]
        dist.all_gather(all_sizes, sizes, group=self.group)
        lengths = [int(s.item()) for s in all_sizes]
        longest = max(lengths)
        if tensor.shape[axis] < longest:  # torch's all_gather needs equal shapes: pad, then trim
            pad_shape = list(tensor.shape)
            pad_shape[axis] = longest - tensor.shape[axis]
            tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=axis)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat([p.narrow(axis, 0, n) for p, n in zip(parts, lengths)], dim=axis).to(home)


class ThreadRendezvous:
    """Meeting point for the replica threads of one process.

    ``exchange`` deposits a value and returns every replica's value; a replica
    that fails calls ``abort`` so that the others do not wait forever.
    """

    def __init__(self, num_replicas: int, timeout_s: float = 300.0):
        self.num_replicas = num_replicas
        # A collective that not every replica joins fails after timeout_s instead of hanging.
        self._barrier = threading.Barrier(num_replicas, timeout=timeout_s)
        self._slots: list[Any] = [None] * num_replicas

    def wait(self) -> None:
        self._barrier.wait()

    def exchange(self, local_id: int, value: Any) -> list[Any]:
        self._slots[local_id] = value
        self.wait()
        values = list(self._slots)
        self.wait()  # nobody deposits the next value before everyone has read this one
        return values

    def all_reduce_mean_(
        self, local_id: int, tensors: list[torch.Tensor | None], ops: Any, meanwhile: Callable[[], None] | None = None
    ) -> None:
        """Average ``tensors`` in place over the replicas (gradients of mirrored copies).

        The cross-device ops ``ops`` say which replica reduces each tensor and how
        (by default replica ``r`` takes every ``num_replicas``-th one, so the work
        is shared); the result is written into all copies, which end bitwise equal.
        ``meanwhile`` runs while every replica is inside this call.
        """
        self._slots[local_id] = tensors
        self.wait()
        lists = list(self._slots)
        for j in range(len(tensors)):
            row = [lst[j] for lst in lists]
            copies = [t for t in row if t is not None]
            if copies and ops._thread_owner(j, row) == local_id:
                ops._all_reduce_copies_(copies, self.num_replicas)
        if meanwhile is not None:
            meanwhile()
        self.wait()

    def abort(self) -> None:
        self._barrier.abort()

    def reset(self) -> None:
        self._barrier.reset()


class _Stop:
    pass


class ReplicaThreads:
    """Runs one callable per local replica on threads created once, not per step.

    Replica 0 runs on the calling thread; replicas 1..n-1 on their own threads.
    The threads hold no reference to this object or to a finished job, so a
    strategy that is no longer used is freed and its threads stop and are joined
    (at the latest when the interpreter exits, before it tears torch down).
    """

    def __init__(self, num_replicas: int, rendezvous: ThreadRendezvous):
        self.num_replicas = num_replicas
        self.rendezvous = rendezvous
        self._inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(num_replicas)]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(
                target=_serve, args=(i, self._inboxes[i], self._done, rendezvous),
                name=f"dlaunch-replica-{i}", daemon=True,
            )
            for i in range(1, num_replicas)
        ]
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(self, _stop_and_join, self._inboxes, self._threads)

    def close(self) -> None:
        """Stop and join the replica threads now."""
        self._finalizer()

    def run(self, job: Callable[[int], Any]) -> list[Any]:
        """Call ``job(local_id)`` for every local replica; return the results in order."""
        n, inboxes, done = self.num_replicas, self._inboxes, self._done
        for i in range(1, n):
            inboxes[i].put(job)
        results: list[Any] = [None] * n
        results[0], exc = _call(job, 0, self.rendezvous)
        errors = None if exc is None else {0: exc}  # built only when something failed: this is per step
        for _ in range(1, n):
            i, results[i], exc = done.get()
            if exc is not None:
                errors = {**(errors or {}), i: exc}
        if errors:
            self.rendezvous.reset()
            raise _root_error([errors.get(i) for i in range(n)])
        return results


def _serve(local_id: int, inbox: queue.SimpleQueue, done: queue.SimpleQueue, rendezvous: ThreadRendezvous) -> None:
    while True:
        job = inbox.get()
        if job is _Stop:
            return
        _answer(done, local_id, job, rendezvous)
        job = None  # a finished job must not keep its strategy alive


def _answer(done: queue.SimpleQueue, local_id: int, job: Callable[[int], Any], rendezvous: ThreadRendezvous) -> None:
    """Run ``job`` and hand back its result; its locals (a failure's traceback holds the job) end with this frame."""
    done.put((local_id, *_call(job, local_id, rendezvous)))


def _call(job: Callable[[int], Any], local_id: int, rendezvous: ThreadRendezvous) -> tuple[Any, BaseException | None]:
    try:
        return job(local_id), None
    except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
        rendezvous.abort()  # release replicas waiting for this one
        return None, exc


def _stop_and_join(inboxes: list[queue.SimpleQueue], threads: list[threading.Thread]) -> None:
    for box in inboxes[1:]:
        box.put(_Stop)
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout=10)


def _root_error(errors: list[BaseException | None]) -> BaseException:
    """The error that caused the others: broken barriers are only a consequence."""
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    return (real or [e for e in errors if e is not None])[0]


def device_guard(device: torch.device) -> ContextManager:
    """Make ``device`` current for CUDA kernels launched by this thread."""
    import contextlib

    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
