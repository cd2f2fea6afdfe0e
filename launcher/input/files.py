"""File-backed datasets: rows read from jsonl, csv, ``.pt`` or ``.npy`` files.

Every format reads into *columns*: a dict of tensors by field name that share
their first dimension (one row per element).

* ``jsonl``: one JSON object per line; each field is a number or a (nested) list
  of numbers, e.g. ``{"x": [0.1, 0.2], "y": [1.5]}``.
* ``csv``: a header, then numbers; every column becomes a float32 tensor. Columns
  named ``x.0, x.1, ...`` are gathered into one field ``x`` of width n.
* ``pt``: ``torch.save({"x": tensor, "y": tensor}, path)``; loaded with
  ``weights_only=True``, so a file cannot run code.
* ``npy``: one array per file. A structured array (``dtype=[("x", "f4", (32,)),
  ("y", "f4", (1,))]``) gives one field per name; a plain array gives the field
  ``data``. Loaded with ``allow_pickle=False``.

Example::

    ds = FileDataset.from_patterns(["data/train-*.jsonl"]).shuffle(seed=0).batch(64).select("x", "y")
    for x, y in ds:          # global batches, as one worker sees them
        ...
    dist = strategy.experimental_distribute_dataset(ds)   # sharded by InputOptions.auto_shard_policy
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence


if TYPE_CHECKING:  # validation resolves and checks files without loading torch; the readers import it
    import torch

from launcher.input.auto_shard import AutoShardPolicy, ShardPlan
from launcher.input.readers import FORMATS, Columns, FieldWidth, count_rows, field_width, num_rows, read_columns, read_file

__all__ = ["FORMATS", "FieldWidth", "FileDataset", "count_rows", "num_rows", "read_columns", "read_file", "resolve_files",
           "write_file", "write_shards"]



# ---------- which files ----------
def resolve_files(patterns: str | Sequence[str], root: str | Path | None = None) -> list[str]:
    """Absolute paths of the files ``patterns`` match, sorted per pattern, in pattern order.

    Relative patterns are taken from ``root`` (default: the current directory). An
    existing file's path is taken as it is, so resolving a resolved list again
    gives the same list.
    """
    base = Path(root) if root is not None else Path.cwd()
    found: dict[str, None] = {}
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        path = Path(pattern).expanduser()
        path = path if path.is_absolute() else base / path
        matches = [str(path)] if path.is_file() else sorted(m for m in glob.glob(str(path), recursive=True) if Path(m).is_file())
        if not matches:
            raise FileNotFoundError(_no_match(pattern, path))
        found.update(dict.fromkeys(str(Path(m).resolve()) for m in matches))
    return list(found)


def _files_in(pattern: str, folder: Path) -> str:
    """What to give instead of a folder: a glob of the data files it holds (``'data/*.csv'``), or that it holds none."""
    held = sorted({p.suffix.lstrip(".").lower() for p in folder.iterdir() if p.is_file()} & set(FORMATS), key=FORMATS.index)
    if not held:
        return f"it holds no {', '.join(FORMATS[:-1])} or {FORMATS[-1]} file; give the data files, e.g. 'data/train-*.jsonl'"
    globs = " or ".join(repr(str(Path(pattern) / f"*.{suffix}")) for suffix in held)
    mixed = " (the files of one input share a format)" if len(held) > 1 else ""
    return f"give the files in it, e.g. {globs}{mixed}"


def _no_match(pattern: str, path: Path) -> str:
    """Why ``pattern`` gives no file, in the user's words."""
    if not pattern.strip():
        return "an empty pattern matches no file; give a glob such as 'data/train-*.jsonl'"
    if path.is_dir():
        return f"{pattern!r} is a directory; {_files_in(pattern, path)}"
    if path.is_symlink() and not path.exists():
        return f"{pattern!r} is a symbolic link to nothing ({os.readlink(path)})"
    if path.exists():
        return f"{pattern!r} is not a regular file"
    found = [m for m in glob.glob(str(path), recursive=True) if not Path(m).is_file()]
    if found:
        return f"{pattern!r} matches {len(found)} path(s), none of them a regular file (e.g. {found[0]})"
    return f"no file matches {pattern!r} (looked in {path.parent})"


def infer_format(files: Sequence[str]) -> str:
    """The format named by the files' common extension."""
    suffixes = sorted({Path(f).suffix.lstrip(".").lower() for f in files})
    if len(suffixes) != 1:
        raise ValueError(f"the files have different extensions ({', '.join(suffixes)}); set the format explicitly")
    if suffixes[0] not in FORMATS:
        raise ValueError(f"cannot infer the format from the extension {suffixes[0]!r}; allowed: {', '.join(FORMATS)}")
    return suffixes[0]


# ---------- writing ----------
def write_file(path: str | Path, columns: Columns, fmt: str | None = None) -> Path:
    """Write ``columns`` in ``fmt`` (default: the extension's); ``read_file`` gives them back."""
    import torch

    path = Path(path)
    fmt = fmt or infer_format([str(path)])
    num_rows(columns)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        lists = {k: v.tolist() for k, v in columns.items()}
        n = num_rows(columns)
        path.write_text("".join(json.dumps({k: lists[k][i] for k in lists}) + "\n" for i in range(n)))
    elif fmt == "csv":
        _write_csv(path, columns)
    elif fmt == "pt":
        torch.save(dict(columns), path)
    elif fmt == "npy":
        import numpy as np

        dtype = [(k, v.numpy().dtype, tuple(v.shape[1:])) for k, v in columns.items()]
        array = np.empty(num_rows(columns), dtype=dtype)
        for k, v in columns.items():
            array[k] = v.numpy()
        np.save(path, array, allow_pickle=False)
    else:
        raise ValueError(f"unknown format {fmt!r}; allowed: {', '.join(FORMATS)}")
    return path


def _write_csv(path: Path, columns: Columns) -> None:
    import torch

    header, blocks = [], []
    for name, v in columns.items():
        if v.dim() > 2:
            raise ValueError(f"csv holds scalars or vectors per row; field {name} has shape {tuple(v.shape)}")
        header += [name] if v.dim() == 1 else [f"{name}.{i}" for i in range(v.shape[1])]
        blocks.append(v.reshape(v.shape[0], -1).double())
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(torch.cat(blocks, dim=1).tolist() if blocks else [])


def write_shards(columns: Columns, directory: str | Path, shards: int, fmt: str = "jsonl", prefix: str = "train") -> list[Path]:
    """Split ``columns`` into ``shards`` files ``PREFIX-00000-of-0000N.FMT`` of near-equal size."""
    n = num_rows(columns)
    bounds = [i * n // shards for i in range(shards + 1)]
    # clone: torch.save of a slice would store the whole tensor's memory
    return [
        write_file(Path(directory) / f"{prefix}-{i:05d}-of-{shards:05d}.{fmt}", {k: v[bounds[i] : bounds[i + 1]].clone() for k, v in columns.items()}, fmt)
        for i in range(shards)
    ]


# ---------- the dataset ----------
@dataclasses.dataclass(frozen=True)
class FileDataset:
    """Elements read from ``files``: a dict of tensors per element, or a tuple after ``select``.

    Like a ``tf.data`` pipeline, it is described, not loaded: ``shuffle``,
    ``batch`` and ``select`` return new datasets. Iterating it reads the files and
    yields global batches; ``strategy.experimental_distribute_dataset`` shards it
    across workers first (see ``AutoShardPolicy``).
    """

    files: tuple[str, ...]
    format: str | None = None
    global_batch_size: int | None = None
    drop_remainder: bool = True
    shuffle_seed: int | None = None  # None: file order
    fields: tuple[str, ...] | None = None  # None: batches are dicts
    _passes: int = dataclasses.field(default=0, init=False, compare=False, repr=False)  # iter() calls: the next epoch

    def __post_init__(self) -> None:
        if not self.files:
            raise ValueError("a FileDataset needs at least one file")
        object.__setattr__(self, "files", tuple(str(f) for f in self.files))
        fmt = self.format or infer_format(self.files)
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; allowed: {', '.join(FORMATS)}")
        object.__setattr__(self, "format", fmt)

    @classmethod
    def from_patterns(cls, patterns: str | Sequence[str], format: str | None = None, root: str | Path | None = None) -> "FileDataset":
        """The files that glob ``patterns`` match (see ``resolve_files``)."""
        return cls(tuple(resolve_files(patterns, root)), format)

    def batch(self, global_batch_size: int, drop_remainder: bool = True) -> "FileDataset":
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        return dataclasses.replace(self, global_batch_size=global_batch_size, drop_remainder=drop_remainder)

    def shuffle(self, seed: int) -> "FileDataset":
        """Reshuffle the elements every epoch (epoch e uses ``seed + e``): the same order on every worker."""
        return dataclasses.replace(self, shuffle_seed=seed)

    def select(self, *fields: str) -> "FileDataset":
        """Batches become tuples of these fields, in this order."""
        return dataclasses.replace(self, fields=tuple(fields))

    def shard(self, plan: ShardPlan) -> "FileShard":
        """Load this worker's share (only its own files under FILE)."""
        return FileShard(self, plan)

    def __iter__(self) -> Iterator[Any]:
        """One epoch, the next at each call (a shuffled dataset reshuffles, as ``tf.data`` does)."""
        epoch = self._passes
        object.__setattr__(self, "_passes", epoch + 1)
        shard = self.shard(ShardPlan(AutoShardPolicy.OFF))
        return (shard.collate(rows) for rows in shard.batches(epoch=epoch))

    def check_width(self, field: str, width: int, key: str) -> None:
        """Raise ``FieldWidth`` where the first file's rows of ``field`` do not hold ``width`` numbers: a model built
        from setting ``key`` would fail on them with torch's shape error, which names neither the file nor the key."""
        found = field_width(self.files[0], self.format, field) if self.files else None
        if found is not None and found != width:
            raise FieldWidth(f"{self.files[0]}: field {field!r} holds {found} number(s) per row, but the model is built "
                             f"for {key}={width}: set {key}={found} (or write files whose {field} holds {width})")


class MissingFields(LookupError):
    """The recipe selects fields (``FileDataset.select``) that the input files do not hold."""

    explained = True  # the message names the fields, the files' own and a file: dlaunch's frames add nothing


class FileShard:
    """One worker's rows of a ``FileDataset``, cut into its per-step batches."""

    def __init__(self, dataset: FileDataset, plan: ShardPlan):
        if dataset.global_batch_size is None:
            raise ValueError("distribute a batched FileDataset: call .batch(global_batch_size) first")
        self.dataset, self.plan = dataset, plan
        self.files = plan.files(dataset.files)
        self.columns = read_columns(self.files, dataset.format)
        self.num_rows = num_rows(self.columns)
        if dataset.fields:
            missing = [f for f in dataset.fields if f not in self.columns]
            if missing and self.columns:
                raise MissingFields(f"the recipe reads fields {missing}, which the input files do not hold (they hold "
                                    f"{sorted(self.columns)}: {self.files[0]}{' ...' if len(self.files) > 1 else ''})")

    def batches(self, epoch: int) -> list[torch.Tensor]:
        """Row indices per step for ``epoch``."""
        import torch

        d = self.dataset
        if d.shuffle_seed is None:
            order = torch.arange(self.num_rows)
        else:
            order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(d.shuffle_seed + epoch))
        return self.plan.worker_batches(order, d.global_batch_size, d.drop_remainder)

    def collate(self, rows: torch.Tensor) -> Any:
        """Only these rows are gathered into a batch."""
        picked = {k: v[rows] for k, v in self.columns.items()}
        return tuple(picked[f] for f in self.dataset.fields) if self.dataset.fields else picked

    def local_batch_size(self) -> int:
        return self.plan.local_batch_size(self.dataset.global_batch_size)
