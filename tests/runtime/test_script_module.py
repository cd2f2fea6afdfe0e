"""``script.module=pkg.train``: a module run as ``python -m`` runs it (torchrun's ``-m``), relative imports and all."""

from __future__ import annotations

import json

import pytest

from launcher.config.script import ScriptSpec

TRAIN = """\
import sys

import torch
import torch.distributed as dist

from .helpers import make_model  # a relative import: `script=pkg/train.py` fails on it, as python pkg/train.py does
from launcher import distribute as dl

strategy = dl.get_strategy()
with strategy.scope():
    model = make_model()
    model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
rank = dist.get_rank() if dist.is_initialized() else 0
print(f"rank {rank}: {__name__} {__package__} {sys.argv[1:]} {sys.argv[0].endswith('pkg/train.py')}")
if "--fail" in sys.argv:
    sys.exit(3)
"""


def _package(root):
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "helpers.py").write_text("import torch\n\ndef make_model():\n    return torch.nn.Linear(4, 1)\n")
    (root / "pkg" / "train.py").write_text(TRAIN)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(), ("strategy=mirrored", "cluster=1x2")], ids=["one", "1x2"])
def test_a_module_runs_as_python_dash_m_runs_it_with_its_relative_imports(run_dlaunch, tmp_path, shape):
    _package(tmp_path)
    proc, run_dir = run_dlaunch("script.module=pkg.train", *shape, "--", "--epochs", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    for rank in range(2 if shape else 1):
        assert f"rank {rank}: __main__ pkg ['--epochs', '3'] True" in said, said[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert "running -m pkg.train --epochs 3" in said


@pytest.mark.slow
def test_a_modules_exit_code_is_dlaunchs_and_names_the_module(run_dlaunch, tmp_path):
    _package(tmp_path)
    proc, _ = run_dlaunch("script.module=pkg.train", "--", "--fail")
    assert proc.returncode == 3 and "pkg.train exited with 3 (sys.exit)" in proc.stderr, proc.stderr[-3000:]


def test_a_package_runs_its_main_and_the_file_gives_the_import_root(tmp_path):
    _package(tmp_path)
    (tmp_path / "pkg" / "__main__.py").write_text("print('main')\n")
    spec = ScriptSpec.model_validate({"module": "pkg"}, context={"cwd": str(tmp_path)})
    assert spec.path == str(tmp_path / "pkg" / "__main__.py") and spec.import_root == tmp_path and spec.name == "pkg"
    spec = ScriptSpec.model_validate({"module": "pkg.train"}, context={"cwd": str(tmp_path)})
    assert spec.import_root == tmp_path and spec.command() == "-m pkg.train"
    again = ScriptSpec.model_validate(spec.model_dump())  # a worker's copy, elsewhere: the parent's file
    assert again.path == spec.path and again.module == "pkg.train"


def test_a_module_not_found_or_not_runnable_is_one_screen(run_dlaunch, tmp_path):
    _package(tmp_path)
    for given, said in ((["script.module=pkg.trian"], "no module pkg.trian under"),
                        (["script.module=pkg.trian"], "did you mean pkg.train?"),
                        (["script.module=pkg"], "is a package without __main__.py, which python -m cannot run"),
                        (["script.module=pkg.train", "script.path=other.py"], "give one of them"),
                        (["script.module=pkg/train.py"], "a module's dotted name (pkg.train), as python -m takes it")):
        proc, _ = run_dlaunch(*given)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_torchruns_module_is_translated_to_script_module():
    from launcher.cli.usage import flag_message

    text = flag_message(["--nproc_per_node=2", "-m", "pkg.train", "--epochs", "1"])
    assert "the same run: dlaunch script.module=pkg.train strategy=mirrored cluster=1x2 -- --epochs 1" in text
