"""``Topology`` and ``DeviceAssignment``: which devices make up each replica, as ``tf.tpu.experimental`` has them.

A topology is the job's devices laid out in a grid (``mesh_shape``; by default
``[1, 1, 1, N]`` for N devices, TPU-style x, y, z, core). A device assignment
cuts it into ``num_replicas`` blocks of ``computation_shape``: each block is
one replica, and each device in it one of the replica's logical devices::

    topology = Topology.from_devices(4)
    assignment = DeviceAssignment.build(topology, computation_shape=[1, 1, 1, 2], num_replicas=2)
    assignment.num_cores_per_replica       # 2 logical devices per replica
    assignment.rank(replica=1, logical_core=0)   # 2: the process that runs it

On torch a device is one process (one rank): rank ``r * L + l`` runs logical
device ``l`` of replica ``r``, so a replica's logical devices are neighbours
(one node, when they fit).
"""

from __future__ import annotations

import math
from typing import Sequence


class Topology:
    """The job's devices as a grid of ``mesh_shape`` (``[1, 1, 1, N]``: N devices in a row).

    What each field means on torch:

    * ``mesh_shape``: how the job's processes (one per device, rank-major) are laid
      out. torch does not report a physical interconnect, so the default is a row;
      a given shape only renames coordinates (``DeviceAssignment.coordinates``).
    * ``num_devices``: the product of ``mesh_shape``: the job's world size.
    * ``missing_devices``: always ``[]``. A TPU slice can come up with failed chips;
      a torch job starts with all of its ranks or fails its rendezvous.

    ``DeviceAssignment.computation_shape`` does matter: it is the shape of each
    replica's logical devices, and ``MeshStrategy`` lays its annotation mesh out
    along those dims (each cut into primes), so splits follow it.
    """

    def __init__(self, mesh_shape: Sequence[int]):
        shape = [int(d) for d in mesh_shape]
        if not shape or any(d < 1 for d in shape):
            raise ValueError(f"mesh_shape must be positive sizes, got {list(mesh_shape)}")
        self.mesh_shape = shape

    @classmethod
    def from_devices(cls, num_devices: int) -> "Topology":
        return cls([1, 1, 1, int(num_devices)])

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def missing_devices(self) -> list:
        """Devices of the grid that are absent: none, ever (see the class docstring)."""
        return []

    def __repr__(self) -> str:
        return f"Topology(mesh_shape={self.mesh_shape})"


class DeviceAssignment:
    """``num_replicas`` replicas of ``num_cores_per_replica`` logical devices each, over a topology's devices."""

    def __init__(self, topology: Topology, computation_shape: Sequence[int], num_replicas: int):
        self.topology = topology
        self.computation_shape = [int(d) for d in computation_shape]
        self.num_replicas = int(num_replicas)

    @classmethod
    def build(cls, topology: Topology | int, computation_shape: Sequence[int] | None = None,
              computation_stride: Sequence[int] | None = None, num_replicas: int = 1) -> "DeviceAssignment":
        """Cut ``topology`` (or a device count) into ``num_replicas`` blocks of ``computation_shape``.

        ``ValueError`` (with the arithmetic) when they do not fit.
        """
        if isinstance(topology, int):
            topology = Topology.from_devices(topology)
        shape = [int(d) for d in (computation_shape or [1] * len(topology.mesh_shape))]
        if computation_stride is not None and any(int(s) != 1 for s in computation_stride):
            raise ValueError("computation_stride other than 1 is not supported: a replica's logical devices are adjacent ranks")
        problem = fit_problem(shape, int(num_replicas), topology.num_devices)
        if problem:
            raise ValueError(problem)
        return cls(topology, shape, num_replicas)

    @property
    def num_cores_per_replica(self) -> int:
        """Logical devices per replica: the product of ``computation_shape``."""
        return math.prod(self.computation_shape)

    @property
    def num_logical_devices_per_replica(self) -> int:
        return self.num_cores_per_replica

    @property
    def core_assignment(self) -> list[list[list[int]]]:
        """``[replica][logical core]`` -> the device's coordinates in the topology's grid."""
        return [[self.coordinates(r, c) for c in range(self.num_cores_per_replica)] for r in range(self.num_replicas)]

    def rank(self, replica: int = 0, logical_core: int = 0) -> int:
        """The process (global rank) that runs ``logical_core`` of ``replica``."""
        self._check(replica, logical_core)
        return replica * self.num_cores_per_replica + logical_core

    def tpu_ordinal(self, replica: int = 0, logical_core: int = 0) -> int:
        return self.rank(replica, logical_core)

    def coordinates(self, replica: int, logical_core: int) -> list[int]:
        """Grid coordinates of the device for (``replica``, ``logical_core``), in the topology's row-major order."""
        index, coords = self.rank(replica, logical_core), []
        for size in reversed(self.topology.mesh_shape):
            coords.append(index % size)
            index //= size
        return coords[::-1]

    def lookup_replicas(self, task_id: int, logical_core: int) -> list[int]:
        """The replicas whose ``logical_core`` runs on process ``task_id`` (one process per device: at most one)."""
        return [r for r in range(self.num_replicas) if self.rank(r, logical_core) == task_id]

    def position(self, rank: int) -> tuple[int, int]:
        """(replica, logical core) of process ``rank``."""
        return divmod(rank, self.num_cores_per_replica)

    def _check(self, replica: int, logical_core: int) -> None:
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} is out of range: the assignment has {self.num_replicas} replicas")
        if not 0 <= logical_core < self.num_cores_per_replica:
            raise ValueError(f"logical core {logical_core} is out of range: each replica has {self.num_cores_per_replica}")

    def __repr__(self) -> str:
        return f"DeviceAssignment(computation_shape={self.computation_shape}, num_replicas={self.num_replicas})"


def fit_problem(computation_shape: Sequence[int], num_replicas: int, devices: int, where: str = "") -> str | None:
    """Why ``num_replicas`` x ``computation_shape`` does not fill ``devices`` exactly (None when it does)."""
    if not computation_shape or any(d < 1 for d in computation_shape):
        return f"computation_shape must be sizes >= 1, got {list(computation_shape)}"
    if num_replicas < 1:
        return f"num_replicas must be >= 1, got {num_replicas}"
    per_replica = math.prod(computation_shape)
    needed = per_replica * num_replicas
    if needed != devices:
        has = where or f"the topology has {devices}"
        return (f"computation_shape {list(computation_shape)} x num_replicas {num_replicas} = {needed} devices, "
                f"but {has}")
    return None
