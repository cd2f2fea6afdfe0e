"""Cheap checks of ``input.files`` in the parent, before anything starts.

Workers read the files; the parent only opens each one and looks at its first
bytes (at most ``HEAD_BYTES``): it exists, is a regular readable file, is not
empty, and starts the way its format does. A jsonl file's first line is a JSON
object of numbers or lists of numbers; a csv file has a header and a numeric
first row; ``.npy`` starts with numpy's magic and a header without Python
objects and as long as the header says; ``.pt`` is the whole zip archive
``torch.save`` writes (or its older pickle format). Beyond the first bytes only
the size and the last ``TAIL_BYTES`` are looked at. Whole files are never
loaded here: a corrupt row further down is still found by the worker that reads it.

    >>> file_problem("data/train-0.jsonl", "jsonl")    # None: looks right
    >>> file_problem("data/empty.jsonl", "jsonl")
    'is empty'
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Callable, Sequence


HEAD_BYTES = 1 << 16
TAIL_BYTES = 1 << 10
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
ZIP_END = b"PK\x05\x06"  # the end-of-central-directory record, in the last bytes of a whole archive
TORCH_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"  # pickle protocol 2 + torch's magic number


def file_problems(files: Sequence[str], fmt: str) -> list[tuple[str, str]]:
    """Each file that cannot be ``fmt``, with why: ``[(path, why), ...]``; empty when all look right."""
    return [(f, why) for f in files if (why := file_problem(f, fmt))]


def file_problem(path: str | Path, fmt: str) -> str | None:
    """Why ``path`` cannot be read as ``fmt``, from its first bytes only; None when it looks right."""
    path = Path(path)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            return "is not a regular file"
        if info.st_size == 0:
            return "is empty"
        if not os.access(path, os.R_OK):
            return "is not readable (permission denied)"
        with path.open("rb") as fh:
            head = fh.read(HEAD_BYTES)
            fh.seek(max(info.st_size - TAIL_BYTES, 0))
            tail = fh.read(TAIL_BYTES)
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    problem = _CHECKS[fmt](head, info.st_size, tail)
    if problem is None:
        return None
    other = looks_like(head)
    hint = f" (it looks like a {other} file: set input.format={other}, or check the file)" if other and other != fmt else ""
    return f"is not a valid {fmt} file: {problem}{hint}"


def looks_like(head: bytes) -> str | None:
    """The format these first bytes suggest, for the hint in a message."""
    if head.startswith((ZIP_MAGIC, TORCH_LEGACY_MAGIC)):
        return "pt"
    if head.startswith(NPY_MAGIC):
        return "npy"
    text = _text(head)
    if text is None:
        return None
    text = text.lstrip()
    return "jsonl" if text.startswith("{") else "csv" if "," in text and not text.startswith("[") else None


def _text(head: bytes) -> str | None:
    try:
        return head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start >= len(head) - 3:  # a character cut at the end of the head
            return head[: exc.start].decode("utf-8")
        return None


def _lines(head: bytes, complete: bool) -> list[str] | None:
    """The head's whole lines, without blank ones (None: not text)."""
    text = _text(head)
    if text is None or "\x00" in text:
        return None
    lines = text.split("\n")
    if not complete:
        lines = lines[:-1]  # the last one may go on past the head
    return [line.rstrip("\r") for line in lines if line.strip()]


# ---------- one check per format: (first bytes, size, last bytes) -> problem or None ----------
def _check_jsonl(head: bytes, size: int, tail: bytes) -> str | None:
    complete = len(head) == size
    lines = _lines(head, complete)
    if lines is None:
        return "it is not UTF-8 text"
    if not lines:
        return "it holds no rows (only blank lines)" if complete else None  # a first line over HEAD_BYTES: left to the worker
    try:
        row = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        return f"its first line is not JSON ({exc.msg}, column {exc.colno})"
    if not isinstance(row, dict) or not row:
        return f"its first line is {_kind(row)}, not a JSON object with fields"
    for key, value in row.items():
        if numeric_shape(value) is None:
            what = "a list that is not numbers of one shape" if isinstance(value, list) and value else _kind(value)
            return f"field {key!r} on its first line is {what}; each field is a number or a list of numbers"
    return None


def numeric_shape(value: Any) -> tuple[int, ...] | None:
    """The shape of a number or a rectangular nested list of numbers; None otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ()
    if not isinstance(value, list) or not value:
        return None
    shapes = {numeric_shape(v) for v in value}
    if len(shapes) != 1 or None in shapes:
        return None
    return (len(value), *shapes.pop())


_KINDS = {bool: "a boolean", str: "a string", type(None): "null", int: "a number", float: "a number", list: "a list", dict: "an object"}


def _kind(value: Any) -> str:
    if isinstance(value, (list, dict)) and not value:
        return "an empty list" if isinstance(value, list) else "an empty object"
    return _KINDS.get(type(value), type(value).__name__)


def _check_csv(head: bytes, size: int, tail: bytes) -> str | None:
    complete = len(head) == size
    lines = _lines(head, complete)
    if lines is None:
        return "it is not UTF-8 text"
    rows = list(csv.reader(io.StringIO("\n".join(lines[:2]))))
    if not rows:
        return None  # a header longer than HEAD_BYTES: left to the worker
    header = rows[0]
    if all(_is_number(cell) for cell in header):
        return f"it has no header row: its first row is numbers ({_clip(lines[0])})"
    if any(not name.strip() for name in header):
        return "its header has an empty column name"
    twice = next((name for name in header if header.count(name) > 1), None)
    if twice is not None:
        return f"its header names column {twice!r} twice"
    if len(rows) < 2:
        return "it has a header but no rows" if complete and len(lines) == 1 else None
    return _csv_row_problem(header, rows[1])


def _csv_row_problem(header: list[str], row: list[str]) -> str | None:
    if len(row) != len(header):
        return f"its first row has {len(row)} value(s) for {len(header)} column(s)"
    bad = next((name for name, cell in zip(header, row) if not _is_number(cell)), None)
    return None if bad is None else f"its first row's {bad!r} is {_clip(row[header.index(bad)])!r}, not a number"


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_npy(head: bytes, size: int, tail: bytes) -> str | None:
    if not head.startswith(NPY_MAGIC):
        return "it does not start with numpy's magic (\\x93NUMPY): np.save writes it"
    import numpy as np  # only for .npy files: a config without them is checked without numpy

    fh = io.BytesIO(head)
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    try:
        reader = readers.get(np.lib.format.read_magic(fh))
        if reader is None:
            return None  # a newer header version: the worker's np.load reads it
        shape, _, dtype = reader(fh)
    except (ValueError, OSError, SyntaxError) as exc:  # numpy reports a damaged header as these
        return f"its header is damaged ({str(exc).splitlines()[0][:80]})"
    if dtype.hasobject:
        return "it holds Python objects (dtype object), which need pickle; save numbers (np.save(path, array))"
    if shape == ():
        return "it holds a single scalar; one row per element needs at least one dimension"
    expected = fh.tell() + math.prod(shape) * dtype.itemsize
    if size < expected:
        return f"it is truncated: its header announces {expected} bytes, the file has {size}"
    return None


def _check_pt(head: bytes, size: int, tail: bytes) -> str | None:
    if head.startswith(TORCH_LEGACY_MAGIC):
        return None
    if not head.startswith(ZIP_MAGIC):
        return "it is not what torch.save writes (a zip archive)"
    name_length = int.from_bytes(head[26:28], "little")
    if not head[30 : 30 + name_length].endswith(b"data.pkl"):
        return "it is a zip archive, but not one torch.save wrote (no data.pkl first)"
    if ZIP_END not in tail:
        return "it is truncated: the zip archive has no end record"
    return None


_CHECKS: dict[str, Callable[[bytes, int, bytes], str | None]] = {
    "jsonl": _check_jsonl, "csv": _check_csv, "npy": _check_npy, "pt": _check_pt,
}
