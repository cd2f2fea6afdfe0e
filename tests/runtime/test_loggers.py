"""Optional loggers: a clear error when tensorboard is missing; the logger itself only where it is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher.runtime import loggers
from launcher.runtime.loggers import LoggerUnavailable, TensorBoardLogger, make_loggers



@pytest.fixture
def no_tensorboard(monkeypatch):
    """Act as if tensorboard were not installed (a None entry in sys.modules makes its import fail)."""
    for name in ("tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)


def test_no_loggers_asked_for():
    assert make_loggers([], Path("unused")) == []


def test_missing_tensorboard_says_how_to_install_it(no_tensorboard, tmp_path):
    with pytest.raises(LoggerUnavailable, match="pip install tensorboard") as caught:
        make_loggers(["tensorboard"], tmp_path)
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, ValueError)
    assert caught.value.name == "tensorboard"
    assert "\n" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # nothing made


def test_missing_tensorboard_fails_the_logger_itself(no_tensorboard, tmp_path):
    with pytest.raises(ImportError, match="pip install tensorboard"):
        TensorBoardLogger(tmp_path / "tb")


@pytest.mark.skipif(loggers.tensorboard_available(), reason="tensorboard is installed here")
def test_missing_tensorboard_unpatched(tmp_path):
    with pytest.raises(ImportError, match="pip install tensorboard"):
        make_loggers(["tensorboard"], tmp_path)


def test_unknown_logger_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown logger.*'wandb'.*choose from: tensorboard"):
        make_loggers(["tensorboard", "wandb"], tmp_path)


def test_unknown_name_is_reported_before_a_missing_package(no_tensorboard, tmp_path):
    with pytest.raises(ValueError, match="'wandb'") as caught:
        make_loggers(["wandb", "tensorboard"], tmp_path)
    assert not isinstance(caught.value, ImportError)


def test_importing_the_module_does_not_import_tensorboard(tmp_path):
    code = "import sys, launcher.runtime.loggers; print(any('tensorboard' in m for m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# --- with tensorboard installed --------------------------------------------------------------------------------------


def test_tensorboard_logger_writes_scalars_at_each_step(tmp_path):
    pytest.importorskip("tensorboard")
    torch = pytest.importorskip("torch")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logger,) = make_loggers(["tensorboard", "tensorboard"], tmp_path)  # asked twice, made once
    assert logger.log_dir == tmp_path / loggers.TENSORBOARD_DIR
    records = [
        {"step": 1, "loss": 2.0, "examples_per_sec": 100.0, "time": 1_700_000_000.5, "note": "text", "ok": True},
        {"step": 10, "loss": 1.0, "examples_per_sec": 110.0, "time": 1_700_000_001.5, "grad_norm": torch.tensor(0.5)},
    ]
    for record in records:
        logger.log(record)
    logger.close()
    logger.close()  # idempotent

    acc = EventAccumulator(str(logger.log_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"loss", "examples_per_sec", "grad_norm"}  # not step, time, text or bools
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [1, 10]
    assert [e.value for e in loss] == pytest.approx([2.0, 1.0])
    assert [e.wall_time for e in loss] == pytest.approx([1_700_000_000.5, 1_700_000_001.5])
    assert [e.step for e in acc.Scalars("grad_norm")] == [10]


def test_tensorboard_logger_needs_a_step(tmp_path):
    pytest.importorskip("tensorboard")
    with TensorBoardLogger(tmp_path) as logger:
        with pytest.raises(ValueError, match="step"):
            logger.log({"loss": 1.0})
