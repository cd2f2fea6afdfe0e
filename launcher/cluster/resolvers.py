"""Cluster resolvers: who is in the job, and where this process sits in it."""

from __future__ import annotations

from launcher.cluster.env import WorkerEnv


class TorchElasticClusterResolver:
    """Describes a job started by torch.distributed.elastic (dlaunch or torchrun).

    Every process is a ``worker``; ``task_id`` is its global rank.
    """

    def __init__(self, env: WorkerEnv, device_type: str = "cpu"):
        self._env = env
        self._device_type = device_type

    @property
    def task_type(self) -> str:
        return "worker"

    @property
    def task_id(self) -> int:
        return self._env.rank

    def cluster_spec(self) -> dict[str, list[str]]:
        """``{"worker": [...]}``, one entry per process.

        torch's rendezvous does not publish worker addresses, so each entry names the
        job's store (``master()``); the list's length is the number of workers.
        """
        return {"worker": [self.master()] * self._env.world_size}

    def master(self) -> str:
        return f"{self._env.master_addr}:{self._env.master_port}"

    def num_accelerators(self) -> dict[str, int]:
        """Accelerators this task uses: one GPU per process on CUDA, none on CPU."""
        return {"GPU": 1} if self._device_type == "cuda" else {}

    def __repr__(self) -> str:
        return f"TorchElasticClusterResolver(task_type='worker', task_id={self.task_id}, world_size={self._env.world_size})"
