"""Run and sweep directories as dlaunch leaves them, written by hand (fast) for the report's tests."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from launcher.runtime import outputs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, *, lr: float, steps: int = 200, status: str | None = "completed",
              metrics: dict | None = None, extra: bool = False, overrides: list[str] | None = None,
              error: str | None = None, where: tuple[str, str, str] = ("linear", "mirrored", "1x2"),
              objective: str = "final_loss") -> None:
    """A run directory as the training loop leaves it; status None: no summary.json (a job that died).

    ``error``: a failed run's exception, kept in summary.json and in error.txt as the terminal showed it.
    """
    run_dir.mkdir(parents=True)
    records = []
    for step in [1, *range(10, steps + 1, 10)]:
        loss = 30.0 * math.exp(-lr * step) + 0.05 + 0.02 * math.sin(step)
        record = {"step": step, "loss": loss, "examples_per_sec": 5000.0 + step, "time": 1.7e9 + step / 100}
        if extra:
            record["grad_norm"] = 1.0 / (1 + step / 20)
            record["lr"] = lr * (1 - step / (2 * steps))
        records.append(record)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe, strategy, cluster = where
    (run_dir / "config.yaml").write_text(f"recipe:\n  name: {recipe}\nstrategy:\n  name: {strategy}\n"
                                         f"cluster:\n  nodes: {cluster[0]}\n  devices_per_node: {cluster[-1]}\n"
                                         f"sweep:\n  objective: {objective}\n")
    if status is not None:
        summary = {"status": status, "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
                   "examples_per_sec": 5100.0, "wall_seconds": 1.5, "recipe": recipe, "strategy": strategy,
                   "cluster": cluster, "steps": steps, "metrics": metrics if metrics is not None else {}}
        if error:
            summary["error"] = {"exception": error, "exit": "exit code 1", "traceback": "Traceback ...\n" + error}
            (run_dir / "error.txt").write_text(f"worker rank 1 failed: root cause\n{error}\n  rank 0: exit code 1\n")
        outputs.write_json_atomic(run_dir / "summary.json", summary)  # as dlaunch writes it: metrics in their order
    hydra = run_dir / ".hydra"
    hydra.mkdir()
    text = "".join(f"- {o}\n" for o in (overrides or [f"recipe.optimizer.lr={lr}", f"trainer.steps={steps}"]))
    (hydra / "overrides.yaml").write_text(text or "[]\n")


def assert_real_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 200 and height >= 200, (path, width, height)
    assert len(data) > 5_000, f"{path} is only {len(data)} bytes"
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))
    assert pixels.shape[:2] == (height, width)
    assert pixels[..., :3].var() > 1e-3, f"{path} is (almost) a single colour"
