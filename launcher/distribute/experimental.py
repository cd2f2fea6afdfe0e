"""``launcher.distribute.experimental``: the names TF keeps under ``tf.distribute.experimental``.

    from launcher.distribute import experimental

    strategy = experimental.CentralStorageStrategy()
    coordinator = experimental.coordinator.ClusterCoordinator(experimental.ParameterServerStrategy(resolver))
"""

from __future__ import annotations

import importlib

_NAMES = {
    "CentralStorageStrategy": "launcher.strategies.central_storage",
    "MultiWorkerMirroredStrategy": "launcher.strategies.multi_worker_mirrored",
    "CommunicationOptions": "launcher.strategies.multi_worker_mirrored",
    "CommunicationImplementation": "launcher.strategies.multi_worker_mirrored",
    "ParameterServerStrategy": "launcher.strategies.parameter_server",
    "TPUStrategy": "launcher.strategies.impl.tpu",
    "FixedShardsPartitioner": "launcher.distribute.partitioners",
    "MinSizePartitioner": "launcher.distribute.partitioners",
    "MaxSizePartitioner": "launcher.distribute.partitioners",
    "ValueContext": "launcher.distribute.input_context",
}
_MODULES = {"coordinator": "launcher.distribute.coordinator"}


def __getattr__(name: str):
    # Strategies import launcher.distribute: looked up on first use, not at import.
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'launcher.distribute.experimental' has no attribute {name!r}")


__all__ = sorted([*_NAMES, *_MODULES])
