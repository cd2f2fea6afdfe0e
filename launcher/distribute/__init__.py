"""The tf.distribute-style API on PyTorch.

Strategies, contexts and values follow ``tf.distribute``'s names and semantics::

    from launcher import distribute as dl

    strategy = dl.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    batches = strategy.experimental_distribute_dataset([torch.arange(8)])
    for x in batches:
        v = strategy.run(lambda t: t, args=(x,))
        strategy.reduce(dl.ReduceOp.SUM, v, axis=None)  # tensor([ 4,  6,  8, 10])
        strategy.reduce(dl.ReduceOp.SUM, v, axis=0)     # tensor(28)
"""

from launcher.distribute.context import (
    ReplicaContext,
    experimental_set_strategy,
    get_loss_reduction,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from launcher.distribute.cross_device_ops import CrossDeviceOps, NcclAllReduce, ReductionToOneDevice
from launcher.distribute.hierarchical import HierarchicalCopyAllReduce
from launcher.distribute.shared_memory import SharedMemoryAllReduce
from launcher.distribute.extended import StrategyExtended
from launcher.distribute.losses import compute_average_loss, scale_loss
from launcher.distribute.input_context import InputContext, InputOptions, InputReplicationMode, ValueContext
from launcher.distribute.reduce_op import ReduceOp
from launcher.distribute.strategy import Strategy
from launcher.distribute.values import PerReplica
from launcher.input.auto_shard import AutoShardPolicy

# Strategies live in launcher/strategies/ (one per file) and import this package's
# modules, so they are looked up on first use rather than imported here.
_STRATEGIES = {
    "CentralStorageStrategy": "launcher.strategies.central_storage",
    "MirroredStrategy": "launcher.strategies.mirrored",
    "MultiWorkerMirroredStrategy": "launcher.strategies.multi_worker_mirrored",
    "CommunicationOptions": "launcher.strategies.multi_worker_mirrored",
    "CommunicationImplementation": "launcher.strategies.multi_worker_mirrored",
    "OneDeviceStrategy": "launcher.strategies.one_device",
    "ParameterServerStrategy": "launcher.strategies.parameter_server",
    "MeshStrategy": "launcher.strategies.mesh",
    "FSDPStrategy": "launcher.strategies.fsdp",
    "TPUStrategy": "launcher.strategies.tpu",
    "RunOptions": "launcher.distribute.run_options",
    "DeviceAssignment": "launcher.distribute.device_assignment",
    "Topology": "launcher.distribute.device_assignment",
    "Server": "launcher.distribute.server",
    "FixedShardsPartitioner": "launcher.distribute.partitioners",
    "MinSizePartitioner": "launcher.distribute.partitioners",
    "MaxSizePartitioner": "launcher.distribute.partitioners",
}


_MODULES = ("experimental", "cluster_resolver", "tpu")


def __getattr__(name: str):
    import importlib

    if name in _STRATEGIES:
        return getattr(importlib.import_module(_STRATEGIES[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"launcher.distribute.{name}")
    raise AttributeError(f"module 'launcher.distribute' has no attribute {name!r}")

__all__ = [
    "AutoShardPolicy",
    "CentralStorageStrategy",
    "CrossDeviceOps",
    "DeviceAssignment",
    "FixedShardsPartitioner",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "MaxSizePartitioner",
    "MeshStrategy",
    "MinSizePartitioner",
    "MirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "SharedMemoryAllReduce",
    "ReplicaContext",
    "RunOptions",
    "Server",
    "Strategy",
    "StrategyExtended",
    "TPUStrategy",
    "Topology",
    "ValueContext",
    "cluster_resolver",
    "compute_average_loss",
    "experimental",
    "experimental_set_strategy",
    "get_loss_reduction",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "scale_loss",
]
