"""The chaos soak (``chaos.py``): N random interruptions, then a run bitwise equal to one never interrupted.

N is ``SOAK_N`` (5 here; ``make soak`` runs 30), the seed ``SOAK_SEED`` (else drawn and printed).
``SOAK_REPORT=PATH`` writes the figures (faults, commands, seconds) as JSON.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch

from launcher.checkpoint import layout, read_tensors
from tests.launch.chaos import Soak, start

N = int(os.environ.get("SOAK_N", "5"))
pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(180 + 60 * N)]  # a command is 10-30 s on a busy machine


def final_state(run_dir) -> dict[str, torch.Tensor]:
    final = layout.latest(run_dir / "checkpoints")
    return {**read_tensors(final, "model"), **{f"optim.{k}": v for k, v in read_tensors(final, "optim").items()}}


def metrics(run_dir) -> tuple[dict[int, float], list[int]]:
    """(loss by step, the steps in the order logged)."""
    records = [r for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "loss" in (r := json.loads(line))]
    return {r["step"]: r["loss"] for r in records}, [r["step"] for r in records]


def test_a_run_interrupted_n_times_at_random_ends_as_if_never_interrupted(tmp_path):
    seed = int(os.environ.get("SOAK_SEED") or random.SystemRandom().randrange(2**32))
    soak = Soak(tmp_path / "chaos", n=N, seed=seed)
    print(soak)

    straight = tmp_path / "straight"
    straight.mkdir()
    started = time.monotonic()
    proc = start(soak.args, straight, tmp_path / "straight.log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    straight_s = time.monotonic() - started

    soak.run()
    figures = {**soak.figures(), "uninterrupted_seconds": straight_s}
    print(json.dumps(figures, indent=1))
    if os.environ.get("SOAK_REPORT"):
        with open(os.environ["SOAK_REPORT"], "w") as fh:
            json.dump(figures, fh, indent=1)

    assert len(soak.faults) == soak.n, f"{soak}: the run ended after {soak.faults}"
    expected, got = final_state(straight), final_state(soak.run_dir)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), f"{soak}: {key} differs from the uninterrupted run's"
    curve_a, _ = metrics(straight)
    curve_b, steps = metrics(soak.run_dir)
    assert steps == list(range(1, soak.steps + 1)), f"{soak}: a step is missing or repeated: {steps}"
    assert curve_b == curve_a, f"{soak}: the loss curve differs from the uninterrupted run's"

    history = json.loads((soak.run_dir / "summary.json").read_text())["history"]
    want = soak.expected_history()
    assert {k: history[k] for k in want} == want, f"{soak}: {history} != {want}"
    starts = want["commands"] + want["restarts"]
    resumable = sum(c.resumable for c in soak.commands[-want["commands"]:])
    assert resumable <= history["resumes"] <= starts - 1, f"{soak}: {history}"
