"""``InputContext``, ``InputOptions``, ``InputReplicationMode`` and ``ValueContext``."""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

from launcher.input.auto_shard import AutoShardPolicy

COPY_STREAMS = ("compute", "side")  # InputOptions.copy_stream, input.copy_stream: launcher/input/prefetch.py


class InputReplicationMode(enum.Enum):
    """How ``distribute_datasets_from_function`` calls the dataset function.

    * ``PER_WORKER``: once per worker process; every local replica dequeues a
      batch from that one dataset each step.
    * ``PER_REPLICA``: once per replica; each replica reads its own dataset.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for the distributed-dataset APIs.

    Args:
        experimental_fetch_to_device: move each replica's batch onto its device
            (non-blocking, from pinned memory on CUDA).
        experimental_replication_mode: see ``InputReplicationMode``.
        experimental_place_dataset_on_device: with ``PER_REPLICA`` and no fetch, each
            replica's batches are moved to its device as they are read (the dataset
            itself runs on the host: torch has no device-side input pipeline).
            Validated as TF does.
        experimental_per_replica_buffer_size: how many steps are fetched to the
            devices ahead of the one in use (0: on demand). On CUDA the copies run
            from pinned memory, non-blocking; on CPU, where batches are on their
            device already, the steps are read ahead, on the calling thread.
        copy_stream: the CUDA stream of those copies: ``"compute"`` (each device's
            current stream, the one its step runs on, as a hand-written loop copies)
            or ``"side"`` (a stream of their own, overlapping the step in flight;
            see ``launcher.input.prefetch``). dlaunch's, not tf.distribute's.
        auto_shard_policy: how ``experimental_distribute_dataset`` shards a
            file-backed dataset across workers (``AutoShardPolicy``; a name such as
            ``"FILE"`` is accepted). Datasets that are not file-backed are split by
            global batch under AUTO, DATA and OFF alike; FILE rejects them.

    Example::

        options = InputOptions(auto_shard_policy=AutoShardPolicy.DATA, experimental_per_replica_buffer_size=2)
    """

    experimental_fetch_to_device: bool = True
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1
    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO
    copy_stream: Literal[COPY_STREAMS] = "compute"

    def __post_init__(self) -> None:
        object.__setattr__(self, "auto_shard_policy", AutoShardPolicy.from_any(self.auto_shard_policy))
        if self.experimental_place_dataset_on_device and self.experimental_fetch_to_device:
            raise ValueError(
                "`experimental_place_dataset_on_device` can not be set to True when "
                "`experimental_fetch_to_device` is True"
            )
        if (
            self.experimental_place_dataset_on_device
            and self.experimental_replication_mode is InputReplicationMode.PER_WORKER
        ):
            raise ValueError(
                "`experimental_place_dataset_on_device` can not be set to True when "
                "replication mode is PER_WORKER"
            )
        if self.experimental_per_replica_buffer_size < 0:
            raise ValueError("`experimental_per_replica_buffer_size` must be >= 0")
        if self.copy_stream not in COPY_STREAMS:
            raise ValueError(f"`copy_stream` must be one of {COPY_STREAMS}, got {self.copy_stream!r}")


class InputContext:
    """Information an input function needs to batch and shard its dataset.

    Example::

        def dataset_fn(ctx: InputContext):
            batch = ctx.get_per_replica_batch_size(64)
            ...  # keep every ctx.num_input_pipelines-th element, from ctx.input_pipeline_id
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        """The number of input pipelines (one per worker, or one per replica)."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """The id of this pipeline, in ``[0, num_input_pipelines)``."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas in sync, over all workers."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Return ``global_batch_size // num_replicas_in_sync``.

        Raises:
            ValueError: if ``global_batch_size`` is not divisible by ``num_replicas_in_sync``.
        """
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size} is not divisible by "
                f"`num_replicas_in_sync` {self._num_replicas_in_sync}"
            )
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


class ValueContext:
    """What ``experimental_distribute_values_from_function`` tells ``value_fn``."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )
