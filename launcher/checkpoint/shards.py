"""Checkpoints of a parameter-server job, written by the ps tasks from their shards.

Each ps task writes its shards as chunks of the whole variables, through
torch.distributed.checkpoint over a gloo group of the ps tasks: the keys are
the ones a one-device run uses (``model.NAME``, ``optim.state.NAME.KEY``,
``optim.param_groups...``, ``progress.*``), and each shard is a chunk at its
row offset. DCP's metadata then describes whole variables, so the checkpoint
loads into a one_device run (DCP reassembles the chunks), into another
parameter-server layout (each ps reads the rows it holds), or through
``launcher.checkpoint.read_tensors``.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from launcher.checkpoint import state
from launcher.checkpoint.safe import SafeLoadPlanner, SafeReader


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A local tensor that is rows ``offset ..`` of a variable of shape ``whole``."""

    tensor: torch.Tensor
    offset: int
    whole: tuple[int, ...]

    @property
    def offsets(self) -> torch.Size:
        return torch.Size([self.offset, *([0] * (len(self.whole) - 1))])


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes each ``(fqn, Chunk)`` as a shard of its whole variable; the state dict's other entries as DCP does."""

    def __init__(self, chunks: list[tuple[str, Chunk]]):
        super().__init__()
        self.chunks = {(fqn, tuple(c.offsets)): c for fqn, c in chunks}

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        items = [*plan.items, *(_write_item(fqn, c) for (fqn, _), c in self.chunks.items())]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        chunk = self.chunks.get((index.fqn, tuple(index.offset or ())))
        return chunk.tensor if chunk is not None else super().lookup_object(index)


def _write_item(fqn: str, c: Chunk) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, c.offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=c.offsets, sizes=c.tensor.size()),
            properties=TensorProperties.create_from_tensor(c.tensor),
            size=torch.Size(c.whole),
        ),
    )


class ChunkLoadPlanner(SafeLoadPlanner):
    """Reads into each ``(fqn, Chunk)`` the rows it covers, however the checkpoint was cut."""

    def __init__(self, chunks: list[tuple[str, Chunk]]):
        super().__init__(allow_partial_load=True)
        self.chunks = {(fqn, tuple(c.offsets)): c for fqn, c in chunks}

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        items = list(plan.items)
        for (fqn, _), c in self.chunks.items():
            if fqn not in self.metadata.state_dict_metadata:
                raise KeyError(f"the checkpoint has no {fqn}")
            local = ChunkStorageMetadata(offsets=c.offsets, sizes=c.tensor.size())
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [local])
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        chunk = self.chunks.get((index.fqn, tuple(index.offset or ())))
        return chunk.tensor if chunk is not None else super().lookup_tensor(index)


# ---------- a ps task's part ----------
def fill_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Give every parameter its optimizer state (a step with zero gradients at lr 0), as torch's ``get_state_dict`` does."""
    if optimizer is None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = [p for p in params if not optimizer.state.get(p)]
    if not missing:
        return
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p) if any(p is m for m in missing) else None
    with state.filling_state():
        optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    for p in params:
        p.grad = None


def _entries(store: Any) -> tuple[list[tuple[str, Chunk]], dict[str, torch.Tensor]]:
    """This ps's tensors under checkpoint keys: chunks of whole variables, and whole scalars (optimizer steps)."""
    chunks: list[tuple[str, Chunk]] = []
    whole: dict[str, torch.Tensor] = {}
    for key, value in store.shards.items():
        name, offset, shape = store.layout[key]
        chunks.append((f"model.{name}", Chunk(value.detach(), offset, tuple(shape))))
        optim_state = store.optimizer.state.get(value, {}) if store.optimizer is not None else {}
        for skey, svalue in optim_state.items():
            if not torch.is_tensor(svalue):
                continue
            fqn = f"optim.state.{name}.{skey}"
            if svalue.shape == value.shape:
                chunks.append((fqn, Chunk(svalue, offset, tuple(shape))))
            elif offset == 0:  # a per-variable scalar (Adam's step): the first shard's
                whole[fqn] = svalue
    return chunks, whole


def _param_groups(store: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, (names, options) in enumerate(store.groups):
        for key, value in options.items():
            out[f"optim.param_groups.{i}.{key}"] = value
        out[f"optim.param_groups.{i}.params"] = list(names)
    return out


def save(store: Any, path: Path, progress: tuple[int, int, int]) -> None:
    """Write this ps's shards into ``path`` (collective over the ps tasks' process group)."""
    with store.lock:
        fill_optimizer_state(store.optimizer)
        chunks, whole = _entries(store)
        flat: dict[str, Any] = dict(whole)
        if store.index == 0:
            flat.update(_param_groups(store))
            step, epoch, offset = progress
            flat.update({f"progress.{k}": v for k, v in state.progress(step, epoch, offset).items()})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(path), planner=ChunkSavePlanner(chunks),
                     no_dist=not dist.is_initialized())


def load(store: Any, path: Path) -> tuple[int, int, int]:
    """Read this ps's rows of every variable (and their optimizer state) from ``path``; return the saved progress."""
    metadata = SafeReader(str(path)).read_metadata()
    with store.lock:
        fill_optimizer_state(store.optimizer)
        chunks, whole = _entries(store)
        scalars = _scalar_targets(store, metadata)
        flat: dict[str, Any] = {k: v[0] for k, v in scalars.items()}
        progress = state.progress(0, 0, 0)
        flat.update({f"progress.{k}": v for k, v in progress.items()})
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(flat, storage_reader=SafeReader(path), planner=ChunkLoadPlanner(chunks), no_dist=True)
        for targets in scalars.values():
            for other in targets[1:]:
                other.copy_(targets[0])
    return int(flat["progress.step"]), int(flat["progress.epoch"]), int(flat["progress.offset"])


def _scalar_targets(store: Any, metadata: Any) -> dict[str, list[torch.Tensor]]:
    """Per saved scalar state (``optim.state.NAME.step``), this ps's tensors that take it (one per local shard)."""
    targets: dict[str, list[torch.Tensor]] = {}
    if store.optimizer is None:
        return targets
    for key, value in store.shards.items():
        name = store.layout[key][0]
        for skey, svalue in store.optimizer.state.get(value, {}).items():
            fqn = f"optim.state.{name}.{skey}"
            if torch.is_tensor(svalue) and svalue.shape != value.shape and fqn in metadata.state_dict_metadata:
                targets.setdefault(fqn, []).append(svalue)
    return targets
