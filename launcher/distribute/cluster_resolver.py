"""``launcher.distribute.cluster_resolver``: the resolvers, under tf.distribute's module name."""

from launcher.cluster.resolvers import (
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchElasticClusterResolver,
    validate_task,
)

__all__ = [
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchElasticClusterResolver",
    "validate_task",
]
