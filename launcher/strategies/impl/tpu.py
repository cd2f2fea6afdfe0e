"""``TPUStrategy``: the seeds' constructor, over ``MeshStrategy`` (DeviceMesh/DTensor).

Synchronous replicas of one or more logical devices each; every device is one
process. The seed's model-parallel set-up runs as written::

    resolver = TPUClusterResolver(tpu="")
    topology = initialize_tpu_system(resolver)
    device_assignment = DeviceAssignment.build(topology, computation_shape=[1, 1, 1, 2], num_replicas=1)
    strategy = TPUStrategy(resolver, experimental_device_assignment=device_assignment)
"""

from __future__ import annotations

from launcher.distribute.device_assignment import DeviceAssignment
from launcher.distribute.tpu import TPUClusterResolver
from launcher.strategies.impl.mesh import MeshStrategy


class TPUStrategy(MeshStrategy):
    """``MeshStrategy`` built from TF's arguments.

    Args:
        tpu_cluster_resolver: a ``TPUClusterResolver`` for the local job; None: the local job.
        experimental_device_assignment: replicas x logical devices; None: one logical
            device per process (data parallelism over all of them).
        device_type: "cpu" or "cuda"; default: CUDA when visible.
    """

    def __init__(self, tpu_cluster_resolver: TPUClusterResolver | None = None,
                 experimental_device_assignment: DeviceAssignment | None = None, *, device_type: str | None = None,
                 timeout_s: float = 300.0):
        resolver = tpu_cluster_resolver if tpu_cluster_resolver is not None else TPUClusterResolver()
        super().__init__(experimental_device_assignment, device_type=device_type, timeout_s=timeout_s, env=resolver.env)
        self._cluster_resolver = resolver
