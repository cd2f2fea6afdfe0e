"""Optional metric loggers beside ``metrics.jsonl`` (which is always written): ``trainer.loggers: [tensorboard]``.

    loggers = make_loggers(["tensorboard"], run_dir)   # on the chief; raises before training if tensorboard is missing
    for logger in loggers: logger.log({"step": 10, "loss": 0.5, "examples_per_sec": 900.0, "time": time.time()})
    for logger in loggers: logger.close()

TensorBoard event files go in ``RUN_DIR/tensorboard/``, so ``tensorboard --logdir SWEEP_DIR`` shows every job.
The tensorboard package is optional: nothing here imports it until a logger is made.
"""

from __future__ import annotations

import importlib.util
import numbers
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"  # under the run directory
KNOWN = ("tensorboard",)
INSTALL_HINT = "pip install tensorboard"


class LoggerUnavailable(ImportError, ValueError):
    """A logger's package is not installed. An ImportError, and a ValueError for config validation."""


def _tensorboard_missing() -> LoggerUnavailable:
    return LoggerUnavailable(
        f"trainer.loggers: the tensorboard logger needs the tensorboard package, which is not installed: "
        f"{INSTALL_HINT}", name="tensorboard")


def tensorboard_available() -> bool:
    try:
        return importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):
        return False


class TensorBoardLogger:
    """Writes each record's numeric values (not ``step``) as scalars at ``record["step"]``.

    A record's ``time`` (seconds since the epoch) is the scalars' wall time, not a curve of its own.
    """

    def __init__(self, log_dir: Path):
        if not tensorboard_available():
            raise _tensorboard_missing()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's shim raises ImportError for a missing or too old tensorboard
            raise LoggerUnavailable(f"trainer.loggers: the tensorboard logger cannot start ({exc}): "
                                    f"{INSTALL_HINT}", name="tensorboard") from exc
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            raise RuntimeError("TensorBoardLogger.log after close()")
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise ValueError(f"a logged record needs an integer 'step', got {step!r}")
        walltime = _scalar(record.get("time"))
        for key, value in record.items():
            if key in ("step", "time"):
                continue
            scalar = _scalar(value)
            if scalar is not None:
                self._writer.add_scalar(key, scalar, global_step=int(step), walltime=walltime)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "TensorBoardLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _scalar(value: Any) -> float | None:
    """A plain number (not a bool), a numpy scalar or a one-element tensor as a float; None for anything else."""
    if hasattr(value, "numel") and hasattr(value, "item"):  # a torch tensor, without importing torch
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)  # NaN/inf are kept: TensorBoard shows them


def make_loggers(names: list[str], run_dir: Path) -> list[TensorBoardLogger]:
    """The loggers ``names`` asks for (each once, in order), writing under ``run_dir``.

    Raises ValueError for an unknown name and LoggerUnavailable (an ImportError and a ValueError) when a
    logger's package is not installed; both are raised before any logger is made.
    """
    wanted = list(dict.fromkeys(str(n).strip().lower() for n in names))
    unknown = [n for n in wanted if n not in KNOWN]
    if unknown:
        raise ValueError(f"trainer.loggers: unknown logger(s) {', '.join(map(repr, unknown))}; "
                         f"choose from: {', '.join(KNOWN)}")
    if "tensorboard" in wanted and not tensorboard_available():
        raise _tensorboard_missing()
    loggers = []
    for name in wanted:
        if name == "tensorboard":
            loggers.append(TensorBoardLogger(Path(run_dir) / TENSORBOARD_DIR))
    return loggers
