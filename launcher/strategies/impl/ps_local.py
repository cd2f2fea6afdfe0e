"""``ParameterServerStrategy`` with no cluster: the seed's local training.

The seed: "If cluster_spec is not set, it becomes local training where variables
are assigned to local CPU or the only GPU. When each worker has more than one
GPU, operations will be replicated on these GPUs." That is
``CentralStorageStrategy``: the variables once, on the CPU (or the only GPU), and
one replica thread per device. The global step is advanced by the first
replica, once per applied step, as "the first replica of every worker" does
with one worker.
"""

from __future__ import annotations

from typing import Any

import torch

from launcher.strategies.impl.central_storage import _CentralExtended


class LocalPSExtended(_CentralExtended):
    """Central storage that counts the applied steps as the global step."""

    def __init__(self, compute_devices: list[str], parameter_device: str):
        super().__init__(compute_devices, parameter_device)
        self.global_step = 0

    def _prepare(self, module: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        if optimizer is not None:
            optimizer.register_step_post_hook(self._count)  # the one update, made by replica 0
        return super()._prepare(module, optimizer)

    def _count(self, *_: Any) -> None:
        self.global_step += 1


def local_devices(num_gpus_per_worker: int, device: str | None) -> tuple[list[str], str]:
    """The replicas' devices and the variables' device for local training.

    ``num_gpus_per_worker`` replicas (0: one, on the CPU) on ``device``'s type:
    by default the GPUs, or the CPU where there is none (``cpu:0``, ``cpu:1``, ...
    are threads of the one CPU, as ``MirroredStrategy(devices=["cpu:0", "cpu:1"])``).
    """
    if num_gpus_per_worker < 0:
        raise ValueError(f"num_gpus_per_worker must be 0 or more, got {num_gpus_per_worker}")
    if num_gpus_per_worker == 0:
        return ["cpu:0"], "cpu:0"
    kind = torch.device(device).type if device else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and num_gpus_per_worker > torch.cuda.device_count():
        raise ValueError(f"num_gpus_per_worker={num_gpus_per_worker}, but this machine has "
                         f"{torch.cuda.device_count()} GPU(s); pass device='cpu' for CPU replica threads")
    compute = [f"{kind}:{i}" for i in range(num_gpus_per_worker)]
    return compute, compute[0] if num_gpus_per_worker == 1 else "cpu:0"
