"""The parent's cheap look at input files: first bytes only, and a message naming what is wrong."""

from __future__ import annotations

import os

import pytest
import torch

from launcher.input.checks import HEAD_BYTES, file_problem, file_problems
from launcher.input.files import FORMATS, write_file


@pytest.mark.parametrize("fmt", FORMATS)
def test_files_written_by_dlaunch_pass(tmp_path, fmt):
    path = write_file(tmp_path / f"a.{fmt}", {"x": torch.randn(3, 4), "y": torch.randn(3)}, fmt)
    assert file_problem(path, fmt) is None


@pytest.mark.parametrize("content,fmt,says", [
    (b"", "jsonl", "is empty"),
    (b"{\"x\": \"a\"}\n", "jsonl", "field 'x' on its first line is a string"),
    (b"1,2\n3,4\n", "csv", "no header row"),
    (b"x,y\n1,z\n", "csv", "'y' is 'z', not a number"),
    (b"x,y\n", "csv", "a header but no rows"),
    (b"PK\x03\x04" + b"\x00" * 60, "npy", "looks like a pt file"),
    (b"{\"x\": 1}\n", "pt", "looks like a jsonl file"),
])
def test_what_is_wrong_is_said(tmp_path, content, fmt, says):
    path = tmp_path / f"f.{fmt}"
    path.write_bytes(content)
    assert says in file_problem(path, fmt)


def test_only_the_head_is_read(tmp_path):
    """A bad row past the first bytes is the worker's to find: the parent never reads the whole file."""
    path = tmp_path / "big.jsonl"
    good = b'{"x": [0.5, 0.25]}\n'
    path.write_bytes(good * (2 * HEAD_BYTES // len(good)) + b"not json\n")
    assert os.path.getsize(path) > HEAD_BYTES
    assert file_problem(path, "jsonl") is None


def test_a_directory_or_missing_file(tmp_path):
    assert file_problem(tmp_path, "jsonl") == "is not a regular file"
    assert "cannot be read" in file_problem(tmp_path / "gone.jsonl", "jsonl")


def test_every_bad_file_named(tmp_path):
    files = []
    for i, content in enumerate([b'{"x": 1}\n', b"", b"[1]\n"]):
        files.append(str(tmp_path / f"{i}.jsonl"))
        (tmp_path / f"{i}.jsonl").write_bytes(content)
    assert file_problems(files, "jsonl") == [(files[1], "is empty"), (files[2], file_problem(files[2], "jsonl"))]
    assert file_problems(files[:1], "jsonl") == []
