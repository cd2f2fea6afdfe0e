"""TF's TPU entry points, for a torch job whose processes are the devices.

A TPU program starts by finding and initializing the TPU system. A torch job has
no such system: its processes (one per device, started by dlaunch or torchrun)
are the cores, and ``MeshStrategy`` arranges them into replicas of logical
devices. These names let the seed's start-up run line for line::

    resolver = TPUClusterResolver(tpu="")
    experimental_connect_to_cluster(resolver)            # nothing to connect to
    topology = initialize_tpu_system(resolver)           # Topology of the job's processes
    device_assignment = DeviceAssignment.build(topology, computation_shape=[1, 1, 1, 2], num_replicas=1)
    strategy = TPUStrategy(resolver, experimental_device_assignment=device_assignment)
"""

from __future__ import annotations

from typing import Any

from launcher.cluster.env import WorkerEnv
from launcher.cluster.resolvers import ClusterResolver, ClusterSpec
from launcher.distribute.device_assignment import DeviceAssignment, Topology


class TPUClusterResolver(ClusterResolver):
    """The local job, in ``TPUClusterResolver``'s shape: ``tpu=""`` (or ``"local"``) only.

    ``cluster_spec()`` is ``{"worker": [...]}`` with one entry per process (the job's
    store address, as ``TorchElasticClusterResolver`` gives); this process is
    ``worker:RANK``. A named TPU or a ``grpc://`` address is a ``ValueError``: there
    is no TPU service to reach from torch.
    """

    def __init__(self, tpu: str | None = None, *, env: WorkerEnv | None = None, device_type: str = "cpu"):
        if tpu not in (None, "", "local"):
            raise ValueError(f"TPUClusterResolver(tpu={tpu!r}): only the local job can be resolved (tpu='' or 'local'); "
                             "start the processes with dlaunch or torchrun, one per device")
        self._env = env if env is not None else WorkerEnv.from_environ()
        self._device_type = device_type
        self.task_type, self.task_id = "worker", self._env.rank if self._env else 0

    @property
    def env(self) -> WorkerEnv | None:
        """The launcher's description of this process (None when it runs alone)."""
        return self._env

    @property
    def num_devices(self) -> int:
        return self._env.world_size if self._env else 1

    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec({"worker": [self.master() or "localhost:0"] * self.num_devices})

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        return f"{self._env.master_addr}:{self._env.master_port}" if self._env else ""

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None) -> dict[str, int]:
        """One device per process: ``{"GPU": 1}`` on CUDA, none on CPU."""
        return {"GPU": 1} if self._device_type == "cuda" else {}


def experimental_connect_to_cluster(cluster_spec_or_resolver: Any = None, **_: Any) -> None:
    """A no-op: the processes met when the job started (rendezvous); there is no remote cluster to connect to."""


def initialize_tpu_system(cluster_resolver: TPUClusterResolver | None = None) -> Topology:
    """A no-op that returns the job's ``Topology``: one device per process, ``mesh_shape [1, 1, 1, N]``.

    There is no TPU system to initialize or reset; the processes hold no state
    between jobs. Pass the result to ``DeviceAssignment.build``.
    """
    resolver = cluster_resolver if cluster_resolver is not None else TPUClusterResolver()
    return Topology.from_devices(resolver.num_devices)


__all__ = ["DeviceAssignment", "TPUClusterResolver", "Topology", "experimental_connect_to_cluster", "initialize_tpu_system"]
