"""``launcher.distribute.cluster_resolver``: the resolvers, under tf.distribute's module name."""

from launcher.cluster.resolvers import (
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchElasticClusterResolver,
    validate_task,
)
from launcher.distribute.tpu import TPUClusterResolver

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TPUClusterResolver",
    "TFConfigClusterResolver",
    "TorchElasticClusterResolver",
    "validate_task",
]
