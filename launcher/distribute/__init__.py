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
from launcher.distribute.extended import StrategyExtended
from launcher.distribute.input_context import InputContext, InputOptions, InputReplicationMode, ValueContext
from launcher.distribute.reduce_op import ReduceOp
from launcher.distribute.strategy import Strategy
from launcher.distribute.values import PerReplica
from launcher.strategies.mirrored import MirroredStrategy
from launcher.strategies.one_device import OneDeviceStrategy

__all__ = [
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "ValueContext",
    "experimental_set_strategy",
    "get_loss_reduction",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]
