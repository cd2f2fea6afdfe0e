"""What ``Strategy.prepare`` checks and mends in a model and its optimizer before a strategy distributes them, the
same under every strategy."""

from __future__ import annotations

import difflib

import torch

_SET_BY_TORCH = ("params", "initial_lr", "name")  # a group's keys besides the optimizer's defaults: an lr scheduler's, a label


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


def refuse_mistyped_groups(optimizer: torch.optim.Optimizer | None) -> None:
    """A parameter group's key one letter off one the optimizer knows (``weight_decy``, ``lr_``): torch.optim keeps it
    unused and the group trains with the optimizer's default, silently. A key like no known one (a recipe's own
    label) is left alone."""
    known = [*getattr(optimizer, "defaults", {}), *_SET_BY_TORCH]
    for index, group in enumerate(getattr(optimizer, "param_groups", [])):
        for key in group:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.75) if key not in known else []
            if close:
                raise ValueError(f"parameter group {index} of {type(optimizer).__name__} has {key!r}, which it does not "
                                 f"know (did you mean {close[0]!r}?): torch.optim keeps such a key unused, so the group's "
                                 f"{close[0]} is {group.get(close[0])!r}. A key of your own needs a name unlike the "
                                 f"optimizer's ({', '.join(optimizer.defaults)})")

