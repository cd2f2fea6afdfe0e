"""Reading the input files' formats into columns: a dict of tensors by field name, one row per element.

Each reader names the file and line of what it cannot read (``BadRows``), in that format's own terms: a worker
that stops on a file says which and why, not a conversion error from inside the reader.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

FORMATS = ("jsonl", "csv", "pt", "npy")
Columns = "dict[str, torch.Tensor]"


class BadRows(ValueError):
    """A file whose rows its format's reader cannot turn into columns."""

    explained = True  # the message names the file, the line and what is wrong there


def read_file(path: str | Path, fmt: str) -> Columns:
    """One file's columns."""
    reader = _READERS.get(fmt)
    if reader is None:
        raise ValueError(f"unknown format {fmt!r}; allowed: {', '.join(FORMATS)}")
    columns = reader(Path(path))
    num_rows(columns, where=str(path))
    return columns


def num_rows(columns: Columns, where: str = "columns") -> int:
    sizes = {k: (v.shape[0] if v.dim() else None) for k, v in columns.items()}
    if len(set(sizes.values())) > 1 or None in sizes.values():
        raise ValueError(f"{where}: every field needs one row per element; got first dimensions {sizes}")
    return next(iter(sizes.values()), 0)


def read_columns(files: Sequence[str], fmt: str) -> Columns:
    """The rows of ``files``, concatenated in order. Files without rows are skipped."""
    import torch

    named = [(f, c) for f, c in ((f, read_file(f, fmt)) for f in files) if num_rows(c)]
    if not named:
        return {}
    fields = list(named[0][1])
    for f, part in named:
        if list(part) != fields:
            raise ValueError(f"{f}: fields {list(part)} differ from the first file's {fields}")
    return {k: torch.cat([p[k] for _, p in named]) for k in fields}


def _read_jsonl(path: Path) -> Columns:
    import torch

    rows, numbers = [], []
    with path.open() as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                raise BadRows(f"{path}:{number}: not a JSON object ({exc.msg}, column {exc.colno})") from None
            if not isinstance(row, dict) or (rows and row.keys() != rows[0].keys()):
                raise BadRows(f"{path}:{number}: every line must be a JSON object with the first line's fields")
            rows.append(row)
            numbers.append(number)
    columns = {}
    for k in rows[0] if rows else ():
        try:
            columns[k] = torch.tensor([r[k] for r in rows])
        except (TypeError, ValueError, RuntimeError):
            raise _unlike_the_first(path, k, rows, numbers) from None
    return columns


def _unlike_the_first(path: Path, field: str, rows: list[dict], numbers: list[int]) -> BadRows:
    """The first line whose ``field`` is not a number, or a list of numbers of the first line's shape."""
    from launcher.input.checks import numeric_shape  # the parent judges a first line by it too

    first = numeric_shape(rows[0][field])
    at = next((i for i, row in enumerate(rows) if numeric_shape(row[field]) != first or first is None), 0)
    shape = "a number" if first == () else f"numbers of shape {list(first)}" if first else "no numbers"
    return BadRows(f"{path}:{numbers[at]}: field {field!r} holds {_clipped(rows[at][field])}, where line "
                   f"{numbers[0]} holds {shape}; each line's {field!r} must be a number, or numbers of one shape")


def _clipped(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _read_csv(path: Path) -> Columns:
    import torch

    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, [])
        values = [_csv_numbers(path, number, row, header) for number, row in enumerate(reader, 2) if row]
    table = torch.tensor(values, dtype=torch.float32).reshape(len(values), len(header))
    groups: dict[str, list[tuple[int, int]]] = {}
    for j, name in enumerate(header):
        base, dot, index = name.rpartition(".")
        if dot and index.isdigit():
            groups.setdefault(base, []).append((int(index), j))
        else:
            groups[name] = [(-1, j)]
    return {
        name: table[:, cols[0][1]] if cols[0][0] < 0 else table[:, [j for _, j in sorted(cols)]]
        for name, cols in groups.items()
    }


def _csv_numbers(path: Path, number: int, row: list[str], header: list[str]) -> list[float]:
    """One csv row's values: as many as the header names, each a number."""
    if len(row) != len(header):
        raise BadRows(f"{path}:{number}: {len(row)} value(s), but the header names {len(header)} column(s)")
    try:
        return [float(v) for v in row]
    except ValueError:
        column, cell = next((name, v) for name, v in zip(header, row) if not _is_float(v))
        raise BadRows(f"{path}:{number}: column {column!r} holds {cell!r}, not a number (a csv file holds a header "
                      "row, then numbers)") from None


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _read_pt(path: Path) -> Columns:
    import torch

    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise BadRows(f"{path}: a .pt file must hold a dict of tensors (torch.save({{'x': x, 'y': y}}, path))")
    return {str(k): v for k, v in data.items()}


def _read_npy(path: Path) -> Columns:
    import numpy as np  # here, not at the top: validating a config imports this module
    import torch

    array = np.load(path, allow_pickle=False)
    if array.dtype.names:
        return {name: torch.from_numpy(np.ascontiguousarray(array[name])) for name in array.dtype.names}
    return {"data": torch.from_numpy(array)}


_READERS = {"jsonl": _read_jsonl, "csv": _read_csv, "pt": _read_pt, "npy": _read_npy}


def count_rows(path: str | Path, fmt: str) -> int:
    """A file's element count without parsing its values (for the plan)."""
    path = Path(path)
    if fmt in ("jsonl", "csv"):
        with path.open("rb") as fh:
            lines = sum(1 for line in fh if line.strip())
        return max(lines - 1, 0) if fmt == "csv" else lines
    if fmt == "npy":
        import numpy as np

        return int(np.load(path, mmap_mode="r", allow_pickle=False).shape[0])
    return num_rows(_read_pt(path), where=str(path))



def field_width(path: str | Path, fmt: str, field: str) -> int | None:
    """Numbers per row of ``field``: from a jsonl file's first line or a csv header, else from the file's columns;
    None where the file has no such field."""
    import torch

    if fmt == "jsonl":
        with Path(path).open() as fh:
            line = next((line for line in fh if line.strip()), "{}")
        row = json.loads(line)
        return torch.tensor(row[field]).numel() if isinstance(row, dict) and field in row else None
    if fmt == "csv":
        with Path(path).open(newline="") as fh:
            header = next(csv.reader(fh), [])
        return sum(1 for name in header if name == field or name.rpartition(".")[0] == field) or None
    column = read_file(path, fmt).get(field)
    return None if column is None else column[0].numel() if column.dim() else 1


class FieldWidth(ValueError):
    """The input files' rows of a field are not as wide as the recipe's model takes."""

    explained = True  # the message names the file, the width it holds and the key to change


