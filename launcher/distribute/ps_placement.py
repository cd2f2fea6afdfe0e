"""Parameter-server placement: which ps task holds each variable, or each shard of a partitioned one.

As ``ParameterServerStrategy`` does: in creation order, each new variable or shard on the next ps task,
round-robin; a partitioner (launcher/distribute/partitioners.py) says how many shards a variable is cut into;
a variable created in ``extended.colocate_vars_with(v)`` goes whole where ``v`` goes::

    placement = place_module(model, num_ps=2, partitioner=MinSizePartitioner(256 << 10, max_shards=2))
    for row in placement.rows():
        print(*row)   # variable, shape, shard, ps, size
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from launcher.distribute.partitioners import Partitioner, _element_size, _format_bytes, _positive_int, num_shards, shard_rows

__all__ = ["Placement", "Shard", "place", "place_module"]


@dataclasses.dataclass(frozen=True)
class Shard:
    """One piece of a variable (the whole variable when it is not partitioned) on one ps task."""

    name: str
    index: int
    num_shards: int
    offset: int
    shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    ps: int
    trainable: bool = True

    @property
    def key(self) -> str:
        """``name/part_i`` for a shard of a partitioned variable, else ``name``."""
        return f"{self.name}/part_{self.index}" if self.num_shards > 1 else self.name

    @property
    def nbytes(self) -> int:
        """Bytes this shard holds."""
        return math.prod(self.shape) * _element_size(self.dtype)

    def describe(self) -> str:
        """``"i/n rows a-b"`` (1-based shard number, inclusive rows); ``"1/1"`` with no rows."""
        label = f"{self.index + 1}/{self.num_shards}"
        if not self.shape or self.shape[0] == 0:
            return label
        return f"{label} rows {self.offset}-{self.offset + self.shape[0] - 1}"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every variable shard lives; shards are kept in placement order."""

    shards: tuple[Shard, ...]
    num_ps: int

    def of(self, name: str) -> list[Shard]:
        """The shards of variable ``name``, in order; KeyError if it is unknown."""
        found = [s for s in self.shards if s.name == name]
        if not found:
            known = self.names()
            hint = ", ".join(known[:8]) + (", ..." if len(known) > 8 else "")
            raise KeyError(f"no variable named {name!r} in this placement (known: {hint or 'none'})")
        return found

    def on(self, ps: int) -> list[Shard]:
        """The shards ps task ``ps`` holds, in placement order."""
        if not 0 <= ps < self.num_ps:
            raise IndexError(f"ps index {ps} out of range for {self.num_ps} ps task(s)")
        return [s for s in self.shards if s.ps == ps]

    def bytes_per_ps(self) -> list[int]:
        """Total bytes held by each ps task, indexed by task."""
        totals = [0] * self.num_ps
        for shard in self.shards:
            totals[shard.ps] += shard.nbytes
        return totals

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """Printable table rows: (variable, the variable's whole shape, which rows the shard holds, ``ps:K``, the
        shard's size)."""
        return [
            (s.name, str(list(s.full_shape)), s.describe(), f"ps:{s.ps}", _format_bytes(s.nbytes))
            for s in self.shards
        ]

    def names(self) -> list[str]:
        """Variable names in placement order, each once."""
        return list(dict.fromkeys(s.name for s in self.shards))


def _split(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, trainable: bool, pieces: int, first_ps: int, num_ps: int
) -> list[Shard]:
    """Cut one variable into ``pieces`` shards on consecutive ps tasks from ``first_ps``."""
    if pieces == 1:
        return [Shard(name, 0, 1, 0, shape, shape, dtype, first_ps % num_ps, trainable)]
    return [
        Shard(name, i, pieces, offset, (length, *shape[1:]), shape, dtype, (first_ps + i) % num_ps, trainable)
        for i, (offset, length) in enumerate(shard_rows(shape[0], pieces))
    ]


def place(
    variables: Sequence[tuple],
    num_ps: int,
    partitioner: Partitioner | None = None,
) -> Placement:
    """Lay variables out on ps tasks, round-robin over shards.

    ``variables`` are ``(name, shape, dtype, trainable)`` in creation order, or
    ``(name, shape, dtype, trainable, colocate_with)`` with the name of another
    variable (or None). Each variable, or each shard of a partitioned one, takes
    the next ps task (0, 1, ..., num_ps - 1, 0, ...), as TF's
    ParameterServerStrategy does. Only trainable variables are partitioned;
    non-trainable ones (buffers) stay whole. A colocated variable
    (``extended.colocate_vars_with``) goes whole onto the ps task of its
    variable's first shard and takes no turn.
    """
    num_ps = _positive_int("num_ps", num_ps)
    shards: list[Shard] = []
    seen: set[str] = set()
    colocated: dict[str, tuple] = {}
    turn = 0
    for name, shape, dtype, trainable, *rest in variables:
        if name in seen:
            raise ValueError(f"variable {name!r} is listed twice")
        seen.add(name)
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"variable {name!r} has a negative dimension: {list(dims)}")
        if rest and rest[0] is not None:
            colocated[name] = (dims, dtype, bool(trainable), rest[0])
            continue
        pieces = num_shards(partitioner if trainable else None, dims, dtype)
        shards += _split(name, dims, dtype, bool(trainable), pieces, turn, num_ps)
        turn += pieces
    return Placement(tuple(shards + _colocate(colocated, shards)), num_ps)


def _colocate(colocated: dict[str, tuple], placed: list[Shard]) -> list[Shard]:
    """Colocated variables on their variable's ps task (a chain of colocations followed to its end)."""
    home = {s.name: s.ps for s in placed if s.index == 0}
    out: list[Shard] = []
    for name, (dims, dtype, trainable, anchor) in colocated.items():
        path = [name]
        while anchor not in home and anchor in colocated and anchor not in path:
            path.append(anchor)
            anchor = colocated[anchor][3]
        if anchor not in home:
            raise ValueError(f"variable {name!r} is colocated with {anchor!r}, which is not one of the variables placed")
        for n in path:
            home[n] = home[anchor]
        out.append(Shard(name, 0, 1, 0, dims, dims, dtype, home[name], trainable))
    return out


def _non_persistent_buffers(module: torch.nn.Module) -> set[str]:
    """Fully qualified names of the buffers left out of ``module``'s state_dict."""
    names = set()
    for prefix, sub in module.named_modules():
        for local in getattr(sub, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{local}" if prefix else local)
    return names


def place_module(module: torch.nn.Module, num_ps: int, partitioner: Partitioner | None = None) -> Placement:
    """Place a module's parameters, then its persistent buffers, on ps tasks.

    Parameters are trainable when they require grad; buffers never are.
    Only shapes and dtypes are read, so a module on the meta device works.
    Those created in ``extended.colocate_vars_with(v)`` go where ``v`` goes.
    """
    from launcher.distribute.placement import colocated_with

    skip = _non_persistent_buffers(module)
    params = list(module.named_parameters())
    buffers = [(n, b) for n, b in module.named_buffers() if n not in skip]
    names = {id(t): n for n, t in [*params, *buffers]}

    def anchor(name: str, t: torch.Tensor) -> str | None:
        other = colocated_with(t)
        if other is not None and id(other) not in names:
            raise ValueError(f"variable {name!r} was created in colocate_vars_with() of a tensor of shape "
                             f"{list(other.shape)} that is not a variable of this model: colocate with one of its "
                             "parameters or buffers")
        return None if other is None else names[id(other)]

    variables = [(n, tuple(p.shape), p.dtype, p.requires_grad, anchor(n, p)) for n, p in params]
    variables += [(n, tuple(b.shape), b.dtype, False, anchor(n, b)) for n, b in buffers]
    return place(variables, num_ps, partitioner)
