"""Device names: TF-style strings (``"cpu:0"``, ``"/gpu:1"``, ``"GPU:0"``) to torch devices."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # validation names devices without loading torch
    import torch

_NAME = re.compile(r"^(?:.*/)?(?:device:)?(cpu|gpu|cuda|meta)(?::(\d+))?$", re.IGNORECASE)


def canonical_name(name: str | torch.device) -> str:
    """``"/GPU:1"`` -> ``"cuda:1"``, ``"CPU:0"`` -> ``"cpu:0"``, ``"cuda"`` -> ``"cuda:0"``."""
    if not isinstance(name, str):  # a torch.device
        return f"{name.type}:{name.index or 0}"
    match = _NAME.match(name.strip())
    if not match:
        raise ValueError(f"unknown device {name!r}; use names such as 'cpu:0', 'cuda:1' or 'GPU:0'")
    kind = match.group(1).lower()
    kind = "cuda" if kind == "gpu" else kind  # meta: shapes only, to check what a build creates
    return f"{kind}:{int(match.group(2) or 0)}"


def check_present(names: Sequence[str]) -> None:
    """ValueError naming the first CUDA device this machine lacks (torch would fail only at its first use)."""
    import torch

    wanted = [n for n in names if n.startswith("cuda:")]
    count = torch.cuda.device_count() if wanted else 0
    for name in wanted:
        if int(name.split(":")[1]) >= count:
            raise ValueError(f"{name} was asked for, but this machine has {count} CUDA device(s)"
                             + ("; use 'cpu:0' (or 'CPU:0')" if count == 0 else ""))


def to_torch(name: str | torch.device) -> torch.device:
    """The torch device a replica named ``name`` computes on.

    Several CPU replicas (``cpu:0``, ``cpu:1``) share the one CPU device of torch.
    """
    import torch

    kind, index = canonical_name(name).split(":")
    if kind in ("cpu", "meta"):
        return torch.device(kind)
    return torch.device("cuda", int(index))


def default_local_devices() -> list[str]:
    """Every visible GPU, or the CPU when there is none (TF's MirroredStrategy default); the CPU where the launcher
    chose it for this process (``cluster.device=cpu`` on a GPU machine; ``run_function(device="cpu")``)."""
    import torch

    from launcher.cluster.env import announced_device

    if torch.cuda.is_available() and announced_device() != "cpu":
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu:0"]
