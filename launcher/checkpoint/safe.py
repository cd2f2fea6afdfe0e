"""Reading a checkpoint never runs code from it.

torch.distributed.checkpoint (DCP) unpickles its ``.metadata`` file with plain
``pickle`` and non-tensor values with ``torch.load(weights_only=False)``. A
checkpoint directory is data that may come from anywhere, so dlaunch reads
both through allow-lists: the metadata may name only DCP's own metadata
classes, torch dtypes and sizes, and paths; values load with
``weights_only=True``. Tensors themselves are read by DCP with
``weights_only=True`` already. Anything else fails with ``UnsafeCheckpoint``
before a single object of it is built.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from launcher.checkpoint.errors import CheckpointError, UnsafeCheckpoint

_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    *((_METADATA, name) for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                                      "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: str):
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        # Exact names only: protocol 4 resolves dotted names attribute by attribute (torch.os.system).
        if "." not in name and ((module, name) in _ALLOWED or _is_dtype(module, name)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"{self._where} asks to load {module}.{name}, which is not checkpoint metadata; "
            "it was not loaded (a checkpoint may hold only tensors and DCP metadata). "
            "Remove the file, or resume from a checkpoint you trust"
        )


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled through an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream, str(path)).load()
            except UnsafeCheckpoint:
                raise
            except Exception as exc:  # noqa: BLE001 - truncated or foreign bytes
                raise CheckpointError(f"{path} is not readable DCP metadata ({type(exc).__name__}: {exc})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        _files_stay_inside(metadata, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def saved_entries(path: Any, prefix: str) -> dict[str, Any]:
    """The checkpoint's entries under ``prefix`` (names after it), each with its DCP metadata (a tensor's ``size``)."""
    metadata = SafeReader(str(path)).read_metadata().state_dict_metadata
    return {key[len(prefix):]: entry for key, entry in metadata.items() if key.startswith(prefix)}


def _files_stay_inside(metadata: Metadata, path: Any) -> None:
    """The data files the metadata names are plain names in the checkpoint directory (no paths elsewhere)."""
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise UnsafeCheckpoint(f"{path} points at data file {name!r} outside its checkpoint directory; it was not loaded")


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(
                f"checkpoint value {read_item.dest_index.fqn} is not plain data and was not loaded: {_first_line(exc)}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
