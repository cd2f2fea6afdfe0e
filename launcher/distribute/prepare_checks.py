"""What ``Strategy.prepare`` checks and mends in a model and its optimizer before a strategy distributes them, the
same under every strategy."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("dlaunch")

# a group's keys besides the optimizer's defaults: torch's lr schedulers' (OneCycleLR, CyclicLR, SWALR), a label
_SET_BY_TORCH = ("params", "initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr", "name",
                 "param_names")


def align_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """State an optimizer made at construction (Adagrad's sums) follows its parameter to the device.

    ``scope()`` moves parameters when it closes, after an optimizer built inside it may
    already hold state on the CPU. Scalars such as ``step`` stay: torch keeps them on the CPU.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != p.device and p.device.type != "meta":
                    state[key] = value.to(p.device)


def refuse_all_frozen(optimizer: torch.optim.Optimizer | None) -> None:
    """An optimizer whose every parameter is frozen trains nothing: one message under every strategy (DDP refused to
    wrap such a model, a one-device run failed at its first backward)."""
    held = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    if held and not any(p.requires_grad for p in held):
        raise ValueError(f"none of the {len(held)} parameter tensors the optimizer holds requires grad (all frozen): "
                         f"nothing would train. Unfreeze the ones to fine-tune (requires_grad_(True)), before they go "
                         f"to the optimizer")


def refuse_wrapped(module: torch.nn.Module, replicas: int) -> None:
    """A model that DDP, FSDP (either) or, with several replicas, DataParallel wraps already (``torch.compile``'d or
    not): ``prepare()`` would wrap it again (two all-reduces a step, with DDP), or shard what another engine holds.
    The half-way move from a torchrun script keeps ``DDP(model)``."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    inner = getattr(module, "_orig_mod", module)  # torch.compile's OptimizedModule
    wrappers = (torch.nn.parallel.DistributedDataParallel, FullyShardedDataParallel, FSDPModule,
                *((torch.nn.DataParallel,) if replicas > 1 else ()))
    if isinstance(inner, wrappers):
        name = "FSDP2's fully_shard" if isinstance(inner, FSDPModule) else type(inner).__name__
        raise TypeError(f"strategy.prepare() got a model wrapped in {name}: pass the model itself (before that "
                        f"wrapping), and drop the {name}(...) call: prepare() wraps it the way this strategy trains "
                        "(docs/MIGRATION.md)")


def warn_mistyped_groups(optimizer: torch.optim.Optimizer | None) -> None:
    """A parameter group's key one edit off one the optimizer knows (``weight_decy``, ``lr_``): torch.optim keeps it
    unused and the group trains with the optimizer's default, silently. Said once (rank 0), not refused: a key of the
    recipe's own, or one a scheduler writes, may sit that close to a known one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    settings = list(getattr(optimizer, "defaults", {}))  # what a typo would leave at its default
    for index, group in enumerate(getattr(optimizer, "param_groups", [])):
        for key in group:
            if key in settings or key in _SET_BY_TORCH:
                continue
            meant = next((k for k in settings if _one_edit(str(key), k)), None)
            if meant is not None:
                log.warning("parameter group %d of %s has %r, which it does not know (did you mean %r?): torch.optim "
                            "keeps such a key unused, so the group's %s is %r", index, type(optimizer).__name__, key,
                            meant, meant, group.get(meant))


def _one_edit(a: str, b: str) -> bool:
    """``a`` is ``b`` with one character added, dropped, changed, or two neighbours swapped."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        swapped = len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
        return len(diff) == 1 or swapped
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))
