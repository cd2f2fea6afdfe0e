"""``strategy=multi_worker_mirrored``: mirrored across workers (``MultiWorkerMirroredStrategy``, in ``impl/``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from launcher.strategies import forward, unit
from launcher.strategies.mirrored import MirroredSpec


@unit
class MultiWorkerMirroredSpec(MirroredSpec):
    """``strategy=multi_worker_mirrored``: mirrored across worker processes on one or more nodes."""

    name: Literal["multi_worker_mirrored"]  # type: ignore[assignment]
    impl: ClassVar[str] = "launcher.strategies.impl.multi_worker_mirrored"
    exports: ClassVar[tuple[str, ...]] = ("MultiWorkerMirroredStrategy", "CommunicationOptions", "CommunicationImplementation")


__getattr__ = forward(__name__, MultiWorkerMirroredSpec.impl)
