"""The files hostile (and valid) configs point at: recipe modules and input files, written once per session."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import torch

from launcher.input.files import write_file

LINEAR = "from launcher.recipes.linear import Config, build, train_step, evaluate  # noqa: F401\n"
PARTS = "from launcher.recipes.linear import Config, build, train_step  # noqa: F401\n"
RECIPES = {
    "good.py": LINEAR,
    "good_manual.py": PARTS + "def train_step(model, batch, optimizer):\n    return None\n",
    "good_defaults.py": PARTS + "def build(cfg, ctx, extra=None):\n    return None\n",
    "no_build.py": "from launcher.recipes.linear import Config, train_step  # noqa: F401\n",
    "no_train_step.py": "from launcher.recipes.linear import Config, build  # noqa: F401\n",
    "build_not_callable.py": PARTS + "build = 3\n",
    "train_step_not_callable.py": PARTS + "train_step = 'step'\n",
    "build_one_arg.py": PARTS + "def build(cfg):\n    return None\n",
    "build_three_args.py": PARTS + "def build(cfg, ctx, extra):\n    return None\n",
    "step_one_arg.py": PARTS + "def train_step(model):\n    return None\n",
    "step_four_args.py": PARTS + "def train_step(model, batch, optimizer, extra):\n    return None\n",
    "step_builtin.py": PARTS + "train_step = print\n",
    "evaluate_not_callable.py": PARTS + "evaluate = 3\n",
    "evaluate_one_arg.py": PARTS + "def evaluate(model):\n    return {}\n",
    "syntax_error.py": LINEAR + "\ndef broken(:\n    pass\n",
    "indentation_error.py": LINEAR + "    x = 1\n",
    "raises_at_import.py": LINEAR + "raise RuntimeError('no GPU found\\n' + 'more\\n' * 50)\n",
    "import_missing.py": "import nosuch_dependency_xyz  # noqa: F401\n" + LINEAR,
    "sys_exit.py": LINEAR + "import sys\nsys.exit(3)\n",
    "zero_division.py": LINEAR + "1 / 0\n",
    "config_not_recipeconfig.py": PARTS.replace("Config, ", "") + "from pydantic import BaseModel\nclass Config(BaseModel):\n    pass\n",
    "config_not_class.py": PARTS + "Config = 5\n",
    "config_plain_class.py": PARTS + "class Config:\n    pass\n",
    "config_validator_raises.py": PARTS + (
        "from pydantic import field_validator\nfrom launcher.recipes import linear\n"
        "class Config(linear.Config):\n    @field_validator('features')\n    @classmethod\n"
        "    def _boom(cls, v):\n        raise TypeError('boom')\n"),
    "config_required_field.py": PARTS + "from launcher.recipes import linear\nclass Config(linear.Config):\n    extra_required: int\n",
    "empty.py": "",
}
BINARY_RECIPES = {"null_bytes.py": b"x = 1\x00\x00\n", "latin1.py": b"x = '\xe9\xe8'\n"}


def write_recipes(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in RECIPES.items():
        (directory / name).write_text(text)
    for name, data in BINARY_RECIPES.items():
        (directory / name).write_bytes(data)
    (directory / "a_directory.py").mkdir(exist_ok=True)
    (directory / "recipe.txt").write_text(LINEAR)
    return directory


def _columns(rows: int = 4) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(rows, 32), "y": torch.randn(rows, 1)}


def _saved(save) -> bytes:
    """What ``save(file)`` writes."""
    buffer = io.BytesIO()
    save(buffer)
    return buffer.getvalue()


def _zip_of(name: str, text: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr(name, text)
    return buffer.getvalue()


def bad_inputs() -> dict[str, bytes]:
    jsonl = b'{"x": [0.1, 0.2], "y": [1.0]}\n'
    npy = _saved(lambda f: np.save(f, np.zeros((2, 3), dtype=np.float32)))
    pt = _saved(lambda f: torch.save(_columns(), f))
    return {
        **{f"empty.{ext}": b"" for ext in ("jsonl", "csv", "pt", "npy")},
        "blank.jsonl": b"\n  \n\n", "not_json.jsonl": b"hello world\n", "list.jsonl": b"[1, 2]\n",
        "string_field.jsonl": b'{"x": "a", "y": 1}\n', "null_field.jsonl": b'{"x": null}\n',
        "bool_field.jsonl": b'{"x": true}\n', "object_field.jsonl": b'{"x": {"a": 1}}\n', "empty_object.jsonl": b"{}\n",
        "ragged.jsonl": b'{"x": [[1, 2], [3]]}\n', "truncated.jsonl": b'{"x": [0.1,', "binary.jsonl": bytes(range(256)) * 4,
        "number.jsonl": b"5\n", "no_header.csv": b"1,2,3\n4,5,6\n", "not_numbers.csv": b"x,y\n1,abc\n",
        "short_row.csv": b"x,y\n1\n", "header_only.csv": b"x,y\n", "empty_name.csv": b"x,,y\n1,2,3\n",
        "twice.csv": b"x,x\n1,2\n", "binary.csv": bytes(range(256)) * 4, "jsonl_inside.csv": jsonl * 3,
        "text.npy": b"not numpy\n", "truncated.npy": b"\x93NUMPY",
        "objects.npy": _saved(lambda f: np.save(f, np.array([{"a": 1}], dtype=object), allow_pickle=True)),
        "scalar.npy": _saved(lambda f: np.save(f, np.float32(3))), "pt_inside.npy": pt,
        "text.pt": b"not torch\n", "npy_inside.pt": npy, "other_zip.pt": _zip_of("hello.txt", "hi"),
        "pickle.pt": pickle.dumps({"a": 1}), "data.txt": b"1\n", "truncated_data.npy": npy[:-8],
        "truncated_zip.pt": pt[: len(pt) // 2], "bad_pickle.pt": _zip_of("archive/data.pkl", "garbage"),
    }


def write_inputs(directory: Path) -> Path:
    """Bad files by name, ``ok.EXT`` in every format, ``valid/EXT/train-{0,1}.EXT`` and odd paths. A dry run counts
    the rows: a valid file holds a global batch (64 rows), which fewer rows would be refused for."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in bad_inputs().items():
        (directory / name).write_bytes(data)
    for fmt in ("jsonl", "csv", "pt", "npy"):  # each valid file fills a global batch of 64 (linear's) on its own
        write_file(directory / f"ok.{fmt}", _columns(64), fmt)
        for i in range(2):
            write_file(directory / "valid" / fmt / f"train-{i}.{fmt}", _columns(64), fmt)
    torch.save(_columns(64), directory / "legacy.pt", _use_new_zipfile_serialization=False)
    (directory / "a_directory.jsonl").mkdir(exist_ok=True)
    (directory / "empty_dir").mkdir(exist_ok=True)
    os.mkfifo(directory / "fifo.jsonl")
    os.symlink(directory / "nowhere.jsonl", directory / "broken_link.jsonl")
    return directory
