"""The training loop's records (launcher/runtime/loop.py), run in this process: what metrics.jsonl says of grad_norm."""

from __future__ import annotations

import json
import math

import pytest

from launcher.config.compose import compose_and_validate
from launcher.config.plan import Plan
from launcher.runtime.loop import train
from tests.conftest import FIXTURES


def logged(tmp_path, name: str, *overrides: str) -> list[dict]:
    spec = compose_and_validate(["cluster.device=cpu", "strategy=one_device", "trainer.steps=3", "trainer.log_every=1",
                                 *overrides], 0)
    run_dir = tmp_path / name
    run_dir.mkdir()
    train(spec, None, run_dir, Plan.resolve(spec, 0))
    return [r for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "loss" in (r := json.loads(line))]


def test_an_inf_grad_norm_is_written_as_null_and_a_step_that_took_none_writes_no_grad_norm(tmp_path):
    """fp16-mixed with a loss of 1e6 x linear's: every scaled gradient overflows, GradScaler skips the step, the loss
    stays finite; its norm (inf) is the spike to see, so it is written (as null: JSON has no inf), not left out."""
    probe = f"recipe.entry={FIXTURES / 'probe_recipe.py'}"
    skipped = logged(tmp_path, "fp16", probe, "+recipe.loss_factor=1e6", "trainer.precision=fp16-mixed")
    assert [r["grad_norm"] for r in skipped] == [None, None, None]
    assert all(math.isfinite(r["loss"]) for r in skipped) and skipped[-1]["skipped_steps"] == 3
    assert all(r["grad_norm"] > 0 for r in logged(tmp_path, "fp32", probe))
    manual = logged(tmp_path, "manual", f"recipe.entry={FIXTURES / 'manual_recipe.py'}")  # its own backward: no norm taken
    assert len(manual) == 3 and not any("grad_norm" in r for r in manual)


def test_under_cuda_graphs_each_step_and_each_evaluation_begins_an_iteration(tmp_path):
    """compile mode reduce-overhead: torch is told where each training step and each evaluation begins (its
    count of the marks falls by one for each); on the CPU, inductor runs the same graphs without capturing."""
    from torch._inductor.cudagraph_trees import MarkStepBox

    before = MarkStepBox.mark_step_counter
    try:
        records = logged(tmp_path, "graphs", "trainer.compile.enabled=true", "trainer.compile.mode=reduce-overhead",
                         "trainer.eval_every=2")
        lines = (tmp_path / "graphs" / "metrics.jsonl").read_text().splitlines()
        evaluations = sum("eval_loss" in json.loads(line) for line in lines)
        assert [r["step"] for r in records] == [1, 2, 3] and evaluations >= 1
        assert before - MarkStepBox.mark_step_counter == 3 + evaluations
    finally:
        MarkStepBox.mark_step_counter = before


def test_the_summarys_examples_per_second_leaves_out_each_save_once():
    """A save every step (trainer.checkpoint.every_steps=1): the first step's save is in the time aside and in the
    first step's time, and it was taken out twice: the summary read 6.08e+11 examples/s against 35,000 in the step
    lines. 4 steps of 64 rows: each trains 0.1 s and saves 0.9 s; the first also compiles for 2 s."""
    from types import SimpleNamespace

    from launcher.runtime.loop import _examples_per_sec

    spec = SimpleNamespace(trainer=SimpleNamespace(steps=4))
    loop = SimpleNamespace(step_seconds=[3.0, 1.0, 1.0, 1.0], aside_seconds=4 * 0.9, first_aside=0.9,
                           stream=SimpleNamespace(rows_per_batch=64))
    assert _examples_per_sec(spec, 0, 6.0, loop) == pytest.approx(3 * 64 / (3 * 0.1))  # steps 2-4's training time alone
