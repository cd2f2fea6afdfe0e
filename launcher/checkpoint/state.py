"""A rank's state as tensors: model, optimizer, progress and random number generators.

Model and optimizer go through torch's ``get_state_dict`` / ``set_state_dict``
(parameter names as keys, so the same checkpoint loads into a DDP module, a
plain one or mirrored copies, at any world size). RNG states become integer
tensors rather than pickled tuples, so a checkpoint is tensors only and loads
with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any, Iterator

import numpy as np
import torch

_filling = threading.local()


@contextlib.contextmanager
def filling_state() -> Iterator[None]:
    """Around torch's ``get_state_dict`` / ``set_state_dict`` and ``fill_optimizer_state``: the optimizer step they
    take (zero gradients at lr 0) fills the optimizer's state and trains nothing (see ``is_filling``)."""
    _filling.depth = getattr(_filling, "depth", 0) + 1
    try:
        yield
    finally:
        _filling.depth -= 1


def is_filling() -> bool:
    """Whether this thread is inside ``filling_state``: an optimizer step now is not one of training."""
    return getattr(_filling, "depth", 0) > 0


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP or mirrored copies; any other model as it is (its own ``.module`` is its own)."""
    from launcher.distribute.replicated import ReplicaParameters

    wrapped = isinstance(model, (torch.nn.parallel.DistributedDataParallel, ReplicaParameters))
    return model.module if wrapped else model


def primary(optimizer: Any) -> Any:
    """The optimizer of the user's module (mirrored copies have one per replica)."""
    return getattr(optimizer, "primary", optimizer)


def model_and_optimizer(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict  # DCP only where checkpoints are used

    with filling_state():
        module_state, optim_state = get_state_dict(unwrap(model), primary(optimizer))
    return {"model": module_state, "optim": optim_state}


def buffer_keys(model: torch.nn.Module, prefix: str = "model") -> frozenset[str]:
    """The saved keys of ``model``'s buffers (``model.bn.running_mean``): what each rank may hold its own value of."""
    return frozenset(f"{prefix}.{name}" for name, _ in unwrap(model).named_buffers())


def drop_unsaved_settings(optim_state: dict[str, Any], saved: set[str]) -> None:
    """Leave out of the template what the checkpoint has no value for: a setting this run's optimizer has and the
    saved one had not (``initial_lr``, which a schedule adds, resumed from a run without one). The loop sets this
    run's settings again after the load."""
    for i, group in enumerate(optim_state.get("param_groups", [])):
        for name in [n for n in group if n != "params" and f"{i}.{n}" not in saved]:
            del group[name]


def load_model_and_optimizer(model: torch.nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    with filling_state():
        set_state_dict(unwrap(model), primary(optimizer), model_state_dict=state["model"], optim_state_dict=state["optim"])
    for copies in (model, optimizer):  # mirrored copies in one process follow their primary
        if hasattr(copies, "resync"):
            copies.resync()


def rng_state() -> dict[str, torch.Tensor]:
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *mt], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.from_numpy(keys.astype(np.int64)),
        "numpy_extra": torch.tensor([pos, has_gauss, cached], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def rng_template(saved: set[str]) -> dict[str, torch.Tensor]:
    """Tensors to load the saved generators into: those this process has too, by the saved names.

    A checkpoint from a CPU run resumed on a GPU has no CUDA state (the GPU keeps its seeded one),
    and the other way round.
    """
    return {k: torch.empty_like(v) for k, v in rng_state().items() if k in saved}


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "python" in state:
        values = state["python"].tolist()
        has_gauss, gauss = state["python_gauss"].tolist()
        random.setstate((values[0], tuple(values[1:]), gauss if has_gauss else None))
    if "numpy" in state:
        pos, has_np_gauss, cached = state["numpy_extra"].tolist()
        np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), int(pos), int(has_np_gauss), cached))
    for key, value in state.items():
        if key.startswith("cuda") and int(key[4:]) < torch.cuda.device_count():
            torch.cuda.set_rng_state(value, int(key[4:]))


def progress(step: int, epoch: int, offset: int) -> dict[str, torch.Tensor]:
    return {"step": torch.tensor(step), "epoch": torch.tensor(epoch), "offset": torch.tensor(offset)}
