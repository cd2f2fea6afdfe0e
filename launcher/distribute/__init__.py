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

# Everything is looked up on first use: the strategies (in launcher/strategies/) import this
# package's modules, and validating a config imports a few torch-free ones (devices,
# device_assignment) without loading torch through this package.
_NAMES = {
    **dict.fromkeys(("ReplicaContext", "experimental_set_strategy", "get_loss_reduction", "get_replica_context",
                     "get_strategy", "has_strategy", "in_cross_replica_context"), "launcher.distribute.context"),
    **dict.fromkeys(("CrossDeviceOps", "NcclAllReduce", "ReductionToOneDevice"), "launcher.distribute.cross_device_ops"),
    "HierarchicalCopyAllReduce": "launcher.distribute.hierarchical",
    "SharedMemoryAllReduce": "launcher.distribute.shared_memory",
    **dict.fromkeys(("InputContext", "InputOptions", "InputReplicationMode", "ValueContext"), "launcher.distribute.input_context"),
    **dict.fromkeys(("compute_average_loss", "scale_loss"), "launcher.distribute.losses"),
    **dict.fromkeys(("DeviceAssignment", "Topology"), "launcher.distribute.device_assignment"),
    **dict.fromkeys(("FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"), "launcher.distribute.partitioners"),
    "StrategyExtended": "launcher.distribute.extended",
    "ReduceOp": "launcher.distribute.reduce_op",
    "Strategy": "launcher.distribute.strategy",
    "PerReplica": "launcher.distribute.values",
    "AutoShardPolicy": "launcher.input.auto_shard",
    "RunOptions": "launcher.distribute.run_options",
    "Server": "launcher.distribute.server",
    "TPUStrategy": "launcher.strategies.impl.tpu",  # TPUStrategy is MeshStrategy built from a TPU topology
}


_MODULES = ("experimental", "cluster_resolver", "tpu")


def __getattr__(name: str):
    import importlib

    from launcher import strategies

    if name == "__all__":  # `from launcher.distribute import *`: this table's names and every strategy's
        return sorted({*_NAMES, *_MODULES, *strategies.exports()})
    module = _NAMES.get(name) or strategies.exported(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    if name in _MODULES:
        return importlib.import_module(f"launcher.distribute.{name}")
    raise AttributeError(f"module 'launcher.distribute' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __getattr__("__all__")
