"""A shared-memory all-reduce for the processes of one machine (CPU tensors).

On CPU, torch.distributed's gloo backend moves tensors between the processes of
one machine through TCP loopback sockets. For a 7.45 MB gradient that costs
about 6 ms per all-reduce on a 2-core machine: more than a third of a training
step (``docs/PERFORMANCE.md``). The processes of one machine can instead read
each other's memory. This module maps one segment of ``/dev/shm`` into every
process of a group and reduces through it:

1. every rank copies its tensor into its own slot of the segment;
2. barrier; rank ``r`` sums part ``r`` of every slot (in rank order, so every
   rank gets the same bits) into the result area;
3. barrier; every rank copies the whole result back into its tensor.

Steps 1 and 3 are one memory copy each; step 2 reads every slot once, the work
shared between the ranks. Tensors larger than a slot go through in chunks.

The barrier is a counter per rank in the segment (one cache line each) that
every rank polls; polling yields the CPU between reads and backs off to sleeping
after a while. A rank whose process has exited is an error at once (gloo learns
it from a closed socket); one that is alive but never arrives, after ``timeout_s``. It relies on the
store order of x86-64 (data written before a counter is visible before it);
``SharedMemoryGroup.supported()`` is False on other machines, and the caller
then keeps the backend's all-reduce.

The segment is created by rank 0 under ``/dev/shm``, opened by the others, then
unlinked at once: the mappings live on, and nothing is left behind if a process
dies. If a rank cannot open it (another machine), every rank learns so and
``SharedMemoryGroup.create`` returns None.

It plugs into DDP as a communication hook (``SharedMemoryAllReduce``, at the end of this module):
DDP still owns buckets, the order of reduction and the overlap with backward.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from launcher.distribute.collectives import ProcessCollectives
from launcher.distribute.cross_device_ops import CrossDeviceOps, group_key, group_timeout_s

SHM_DIR = "/dev/shm"
LINE = 64  # bytes between two ranks' counters: one cache line each
ALIGN = 4096
DEFAULT_BUDGET = 48 * 2**20  # the segment's size for the slots and the result area
SPIN_BEFORE_SLEEP_S = 0.002  # poll (yielding) this long, then sleep between polls
_COMBINE = {"sum": torch.add, "max": torch.maximum}


class SharedMemoryGroup:
    """The segment, counters and all-reduce of one process group whose ranks share a machine."""

    def __init__(self, segment: mmap.mmap, world_size: int, rank: int, slot_bytes: int, timeout_s: float, pids: list[int]):
        self.world_size = world_size
        self.rank = rank
        self.pids = pids  # every rank's process: a peer that dies is noticed at once, not after timeout_s
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._segment = segment
        header = LINE * world_size
        self._counters = memoryview(segment)[:header].cast("q")
        self._step = LINE // 8
        self._data = torch.frombuffer(segment, dtype=torch.uint8, offset=header, count=(world_size + 1) * slot_bytes)
        self._seq = 0

    # ----- creation (collective) -----
    @staticmethod
    def supported() -> bool:
        """True where this module's barrier is sound (x86-64 store order) and ``/dev/shm`` exists."""
        return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)

    @classmethod
    def create(
        cls, group: Any = None, budget_bytes: int = DEFAULT_BUDGET, timeout_s: float = 300.0
    ) -> "SharedMemoryGroup | None":
        """Map one segment into every rank of ``group``; None (on every rank) if one of them cannot.

        Every rank of ``group`` must call this, in the same order as its other collectives.
        """
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        slot_bytes = _slot_bytes(budget_bytes, world)
        size = LINE * world + (world + 1) * slot_bytes
        ok = cls.supported() and _room_for(size)
        token = secrets.token_hex(8)
        path = os.path.join(SHM_DIR, f"dlaunch-{os.getpid()}-{token}") if rank == 0 else None
        fd = _create(path, size, token) if (rank == 0 and ok) else None
        announced = [path if fd is not None else None, token]
        dist.broadcast_object_list(announced, group_src=0, group=group)
        path, token = announced
        if rank != 0:
            fd = _open(path, size, token) if (path is not None and ok) else None
        everyone = [None] * world
        dist.all_gather_object(everyone, (fd is not None, os.getpid()), group=group)  # also: everyone has opened it
        if rank == 0 and path is not None:
            os.unlink(path)
        if not all(opened for opened, _ in everyone):
            if fd is not None:
                os.close(fd)
            return None
        segment = mmap.mmap(fd, size)
        os.close(fd)
        segment[: LINE * world] = bytes(LINE * world)  # every rank zeroes its view; nobody has counted yet
        dist.barrier(group=group)
        return cls(segment, world, rank, slot_bytes, timeout_s, [pid for _, pid in everyone])

    # ----- the all-reduce -----
    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum", divide_by: int = 1) -> torch.Tensor:
        """In place: ``tensor`` (contiguous, on CPU) becomes the sum (or ``op="max"``) over every rank's ``tensor``.

        ``divide_by``: divide the sum by this (a mean); each rank divides only its
        share, instead of every rank dividing the whole tensor.
        """
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"shared-memory all-reduce needs a contiguous CPU tensor, got {tensor.device} {tuple(tensor.stride())}")
        combine = _COMBINE[op]
        flat = tensor.view(-1)
        per_chunk = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), per_chunk):
            self._reduce_chunk(flat[start : start + per_chunk], combine, divide_by)
        return tensor

    def _reduce_chunk(self, chunk: torch.Tensor, combine: Any, divide_by: int) -> None:
        n = chunk.numel()
        slots = [self._area(i, chunk.dtype, n) for i in range(self.world_size)]
        result = self._area(self.world_size, chunk.dtype, n)
        slots[self.rank].copy_(chunk)
        self._barrier()
        lo, hi = _part(n, self.rank, self.world_size)
        if hi > lo:
            out = result[lo:hi]
            combine(slots[0][lo:hi], slots[1][lo:hi], out=out)
            for slot in slots[2:]:
                combine(out, slot[lo:hi], out=out)
            if divide_by != 1:
                out.div_(divide_by)
        self._barrier()
        chunk.copy_(result)

    def _area(self, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = index * self.slot_bytes
        return self._data[start : start + self.slot_bytes].view(dtype)[:numel]

    def _barrier(self) -> None:
        """Every rank has arrived: its writes before the call are visible to this one."""
        self._seq += 1
        seq, counters, step = self._seq, self._counters, self._step
        counters[self.rank * step] = seq
        for other in range(self.world_size):
            if counters[other * step] < seq:
                self._wait_for(other, seq)

    def _wait_for(self, other: int, seq: int) -> None:
        counters, index = self._counters, other * self._step
        start = time.monotonic()
        polls = 0
        while counters[index] < seq:
            polls += 1
            if polls < 64:
                continue
            os.sched_yield()
            if polls % 256 == 0:
                waited = time.monotonic() - start
                if waited > self.timeout_s:  # worded as gloo's timeout, which the heartbeat explains
                    raise RuntimeError(
                        f"shared-memory all-reduce: Timed out waiting {self.timeout_s:.0f} s for rank {other} "
                        f"(this is rank {self.rank}); a process of the group has stopped or is stuck"
                    )
                if waited > SPIN_BEFORE_SLEEP_S:
                    if not _running(self.pids[other]):  # what a closed socket tells gloo
                        raise RuntimeError(
                            f"shared-memory all-reduce: rank {other} (pid {self.pids[other]}) has exited "
                            f"(this is rank {self.rank})"
                        )
                    time.sleep(0.0001)

    def close(self) -> None:
        self._data = None  # type: ignore[assignment]
        self._counters.release()
        self._segment.close()


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a dead rank its agent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _slot_bytes(budget_bytes: int, world_size: int) -> int:
    per = max(budget_bytes // (world_size + 1), ALIGN)
    return per - per % ALIGN


def _part(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s share of ``numel`` elements, cut at multiples of 16 (no cache line shared)."""
    per = -(-numel // world_size)
    per += -per % 16
    return min(rank * per, numel), min((rank + 1) * per, numel)


def _room_for(size: int) -> bool:
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize > 2 * size


def _create(path: str, size: int, token: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    os.ftruncate(fd, size)
    os.pwrite(fd, token.encode(), 0)  # the others check it: they opened this segment, on this machine
    return fd


def _open(path: str, size: int, token: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    if os.fstat(fd).st_size != size or os.pread(fd, len(token), 0) != token.encode():
        os.close(fd)
        return None
    return fd


class SharedMemoryAllReduce(CrossDeviceOps):
    """Between the processes of one machine, on CPU: a sum through shared memory.

    Every process of the group maps one ``/dev/shm`` segment; each copies its
    tensor in, sums its share of every process's copy, and copies the whole sum
    back (``launcher/distribute/shared_memory.py``). Gradients go through it as
    DDP's communication hook, so DDP still buckets them and starts a bucket as
    soon as backward has filled it. This is what ``cross_device_ops=None`` picks
    for CPU processes that share a machine; gloo's all-reduce (loopback sockets)
    stays in use across machines, for CUDA tensors, and where the segment cannot
    be made.

    Args:
        budget_mb: size of the segment's slots and result area together; larger tensors go through in chunks.
        required: raise when the processes cannot share a segment (other machines,
            no ``/dev/shm``, not x86-64) instead of falling back to the backend.
    """

    name = "shared_memory"

    def __init__(self, budget_mb: float = 48.0, *, required: bool = True):
        if budget_mb <= 0:
            raise ValueError(f"budget_mb must be > 0, got {budget_mb}")
        self.budget_mb = budget_mb
        self.required = required
        self._segments: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> SharedMemoryGroup | None

    def _join(self, processes: ProcessCollectives, env: Any) -> None:
        key = group_key(processes.group)
        if key in self._segments:
            return
        timeout_s = group_timeout_s(processes.group)
        segment = SharedMemoryGroup.create(processes.group, int(self.budget_mb * 2**20), timeout_s)
        self._segments[key] = segment
        if segment is None and self.required:
            raise ValueError(
                "cross_device_ops=shared_memory needs every process of the group on one machine "
                "(x86-64, with room in /dev/shm); leave cross_device_ops unset to use it only where it can work"
            )

    def active(self, group: Any = None) -> bool:
        """True when ``group``'s processes reduce through shared memory."""
        return self._segments.get(group_key(group)) is not None

    def _segment(self, group: Any, tensor: torch.Tensor) -> Any:
        """The group's segment if ``tensor`` can go through it (contiguous, on CPU); else None: the backend's."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        return self._segments.get(group_key(group))

    def _all_reduce_sum_(self, buffer: torch.Tensor, group: Any) -> None:
        segment = self._segment(group, buffer)
        if segment is None:
            return super()._all_reduce_sum_(buffer, group)
        segment.all_reduce_(buffer)

    def _mean_(self, buffer: torch.Tensor, group: Any) -> None:
        """The sum through shared memory, each rank dividing only its share.

        ``(a + b) / 2`` has the bits of DDP's ``a / 2 + b / 2`` (halving is exact
        outside the subnormal range), for half the division work.
        """
        segment = self._segment(group, buffer)
        if segment is None:
            return super()._mean_(buffer, group)
        segment.all_reduce_(buffer, divide_by=dist.get_world_size(group))

    def _check_same_shape(self, tensor: torch.Tensor, processes: Any) -> None:
        segment = self._segments.get(group_key(processes.group))
        if segment is None:
            return super()._check_same_shape(tensor, processes)
        processes.check_same_shape(tensor, all_reduce_max_=lambda t: segment.all_reduce_(t, op="max"))

    def __repr__(self) -> str:
        return f"SharedMemoryAllReduce(budget_mb={self.budget_mb:g})"
