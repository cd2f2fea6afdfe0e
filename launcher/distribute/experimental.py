"""``launcher.distribute.experimental``: the names TF keeps under ``tf.distribute.experimental``.

    from launcher.distribute import experimental

    strategy = experimental.CentralStorageStrategy()
    coordinator = experimental.coordinator.ClusterCoordinator(experimental.ParameterServerStrategy(resolver))
"""

from __future__ import annotations

import importlib

# TF's experimental subset of the package's names, found where launcher.distribute finds them.
_NAMES = ("CentralStorageStrategy", "MultiWorkerMirroredStrategy", "CommunicationOptions", "CommunicationImplementation",
          "ParameterServerStrategy", "TPUStrategy", "FixedShardsPartitioner", "MinSizePartitioner",
          "MaxSizePartitioner", "ValueContext")
_MODULES = {"coordinator": "launcher.distribute.coordinator"}


def __getattr__(name: str):
    # Strategies import launcher.distribute: looked up on first use, not at import.
    if name in _NAMES:
        return getattr(importlib.import_module("launcher.distribute"), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'launcher.distribute.experimental' has no attribute {name!r}")


__all__ = sorted([*_NAMES, *_MODULES])
