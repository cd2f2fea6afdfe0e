"""What a parameter-server training task sees: its module pulled from the ps tasks, an optimizer that pushes.

Also what each ps task is given (``contents_for``). Used by ``ParameterServerStrategy``
(``parameter_server.py`` in this folder) and the ps tasks (``launcher/runtime/ps_task.py``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from launcher.distribute import server as ps_server
from launcher.distribute.ps_placement import Placement
from launcher.distribute.ps_client import Client


# ---------- the model and optimizer a training task sees ----------
class PSModule(torch.nn.Module):
    """The user's module, run on values pulled from the ps tasks at each forward.

    ``.local`` is the user's module on the meta device (its structure, no values).
    An ``nn.Embedding``'s table is never pulled whole: each lookup pulls the rows
    it needs, and its gradient goes back as those rows.
    """

    def __init__(self, module: torch.nn.Module, client: Client, device: torch.device):
        super().__init__()
        self.local = module
        object.__setattr__(self, "_client", client)
        object.__setattr__(self, "_device", device)
        object.__setattr__(self, "records", [])  # (variable, row ids or None, pulled leaf) since the last push
        object.__setattr__(self, "lookups", {})  # embedding -> its forward that pulls rows
        sparse = []
        for prefix, sub in module.named_modules():
            if isinstance(sub, torch.nn.Embedding) and sub.weight.requires_grad:
                name = f"{prefix}.weight" if prefix else "weight"
                sub.forward = self.lookups[sub] = functools.partial(self._lookup, name, sub)  # type: ignore[method-assign]
                sparse.append(name)
        object.__setattr__(self, "sparse_names", sparse)
        object.__setattr__(self, "dense_names", [n for n in client.placement.names() if n not in sparse])
        object.__setattr__(self, "trainable", {s.name: s.trainable for s in client.placement.shards})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in torch.utils._pytree.tree_leaves((args, kwargs))):
            raise MetaInput(f"the model's input is on the meta device: {META_REASON}")
        values = {n: v.to(self._device) for n, v in self._client.pull(self.dense_names).items()}
        if torch.is_grad_enabled():
            for name, value in values.items():
                if self.trainable[name]:
                    value.requires_grad_(True)
                    self.records.append((name, None, value))
        with said_on_meta(self.local):
            return torch.func.functional_call(self.local, values, args, kwargs, strict=False)

    @contextlib.contextmanager
    def materialized(self) -> Iterator[torch.nn.Module]:
        """The user's module holding the variables' values, on this task's device, for an evaluation: a normal model
        (``next(model.parameters()).device`` is where data goes, ``state_dict()`` holds values). Every variable is
        pulled whole, embedding tables too; afterwards the module is shapes on meta again, and forwards pull."""
        local = self.local
        values = self._client.pull(self._client.placement.names())
        held = {**dict(local.named_parameters()), **dict(local.named_buffers())}
        real = {id(held[n]): _like(held[n], v.to(self._device)) for n, v in values.items()}
        slots = [(box, key, t) for m in local.modules() for box in (m._parameters, m._buffers)
                 for key, t in box.items() if t is not None and id(t) in real]  # tied variables: every place
        for box, key, t in slots:
            box[key] = real[id(t)]
        for sub in self.lookups:
            del sub.forward  # the embedding's own lookup, in its table
        try:
            with said_on_meta(local):
                yield local
        finally:
            for box, key, t in slots:
                box[key] = t
            for sub, lookup in self.lookups.items():
                sub.forward = lookup  # type: ignore[method-assign]

    def _lookup(self, name: str, module: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(ids.reshape(-1).cpu(), return_inverse=True)
        rows = self._client.gather(name, unique).to(self._device)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self.records.append((name, unique, rows))
        return F.embedding(inverse.view(ids.shape).to(self._device), rows)

    def gradients(self) -> dict[int, dict[str, Any]]:
        """The recorded gradients, cut to shards and grouped by ps: dense slices, or (rows, values)."""
        out: dict[int, dict[str, Any]] = {}
        for name, ids, leaf in self.records:
            if leaf.grad is None:
                continue
            grad = leaf.grad.detach().cpu()
            for s in self._client.placement.of(name):
                piece = _dense_piece(grad, s) if ids is None else _sparse_piece(ids, grad, s)
                if piece is not None:
                    box = out.setdefault(s.ps, {})
                    box[s.key] = piece if s.key not in box else _add(box[s.key], piece)
        return out

    def param_norm(self) -> float:
        return sum(self._client.each(ps_server.remote_sum_of_squares)) ** 0.5

    def save_to_ps(self, path: Any, progress: tuple[int, int, int]) -> None:
        """Every ps writes its shards into ``path`` (one DCP checkpoint of the whole variables)."""
        self._client.each(ps_server.remote_save, str(path), tuple(progress))

    def load_from_ps(self, path: Any) -> tuple[int, int, int]:
        """Every ps reads its rows from ``path``; returns the saved (step, epoch, batch offset)."""
        return self._client.each(ps_server.remote_load, str(path))[0]

    def state_dict_from_ps(self) -> dict[str, torch.Tensor]:
        """The whole model's values, pulled (small models only: this materializes every table)."""
        return self._client.pull(self._client.placement.names())


META_REASON = ("under strategy=parameter_server a training task's module holds no values: its parameters are shapes "
               "on the meta device (the values live on the ps tasks and are pulled at each forward), so "
               "next(model.parameters()).device is meta in a train_step; a train_step gets its batch on the task's "
               "device already, and evaluate sees the values, on that device")


class MetaInput(RuntimeError):
    """A training task's step moved its data to the meta device (its module's parameters' device)."""


@contextlib.contextmanager
def said_on_meta(module: torch.nn.Module) -> Iterator[None]:
    """A torch error about the meta device in the user's forward gets a note with the reason, in dlaunch's words."""
    try:
        yield
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" in str(exc) and not isinstance(exc, MetaInput):
            left = [f"{prefix}.{n}".lstrip(".") for prefix, m in module.named_modules() for n in m._non_persistent_buffers_set
                    if m._buffers.get(n) is not None and m._buffers[n].is_meta]
            exc.add_note(f"dlaunch: {META_REASON}" + (f"; still on meta here: {', '.join(left[:8])} (a buffer "
                         "registered with persistent=False is not kept on the ps tasks)" if left else ""))
        raise


def _like(old: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.nn.Parameter(value, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else value


def _dense_piece(grad: torch.Tensor, s: Any) -> torch.Tensor:
    return grad if s.num_shards == 1 else grad[s.offset : s.offset + s.shape[0]]


def _sparse_piece(ids: torch.Tensor, grad: torch.Tensor, s: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    mask = (ids >= s.offset) & (ids < s.offset + s.shape[0])
    if not bool(mask.any()):
        return None
    return ids[mask] - s.offset, grad[mask]


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, tuple):
        return torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])
    return a + b


class PSOptimizer:
    """``step()`` pushes the gradients of the last forward(s) to the ps tasks, which hold the real optimizer."""

    def __init__(self, primary: torch.optim.Optimizer, module: PSModule, increments: bool):
        self.primary, self._module, self._increments = primary, module, increments

    @property
    def param_groups(self) -> list[dict]:
        return self.primary.param_groups

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("ParameterServerStrategy's optimizer takes no closure")
        grads = self._module.gradients()
        self._module.records.clear()
        self._module._client.push(grads, increment=self._increments)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._module.records.clear()

    def __repr__(self) -> str:
        return f"PSOptimizer({type(self.primary).__name__} on the ps tasks)"


# ---------- what each ps task is given ----------
def contents_for(ps: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer, placement: Placement) -> dict[str, Any]:
    """ps task ``ps``'s shards of ``module`` (real values), their layout, and the optimizer's groups over them."""
    values = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    mine = placement.on(ps)
    names = {id(p): n for n, p in module.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        group_names = [names[id(p)] for p in group["params"]]
        keys = [s.key for s in mine if s.name in group_names]
        groups.append((group_names, keys, {k: v for k, v in group.items() if k != "params"}))
    return {
        "shards": {s.key: values[s.name].detach()[s.offset : s.offset + s.shape[0]] if s.num_shards > 1 else values[s.name].detach()
                   for s in mine},
        "trainable": {s.key: s.trainable for s in mine},
        "layout": {s.key: (s.name, s.offset, s.full_shape) for s in mine},
        "optimizer_cls": type(optimizer),
        "groups": groups,
    }


# ---------- the strategy ----------
