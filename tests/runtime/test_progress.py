"""The meter behind the step log: examples/s between log points, and a time left that a slow first step does not skew."""

import time
from types import SimpleNamespace

import pytest

from launcher.runtime.progress import Meter


def test_the_time_left_goes_by_the_steps_after_the_first():
    seconds: list[float] = []
    meter = Meter(SimpleNamespace(rows_per_batch=64), total_steps=100, first_step=0, step_seconds=seconds)
    rate, eta = meter.window(1)  # step 1 is being logged: no step has ended yet
    assert eta is None and rate > 0
    seconds += [60.0, 0.5, 0.5, 1.0]  # a first step that compiled for a minute, then three steps
    _, eta = meter.window(5)
    assert eta == pytest.approx((0.5 + 0.5 + 1.0) / 3 * 95)


def test_a_resumed_command_counts_from_its_own_first_step():
    seconds = [30.0, 0.2]
    meter = Meter(SimpleNamespace(rows_per_batch=8), total_steps=60, first_step=40, step_seconds=seconds)
    _, eta = meter.window(42)
    assert eta == pytest.approx(0.2 * 18)


def test_time_spent_aside_is_not_in_the_examples_per_second():
    """An evaluation or a checkpoint save between two log points is not training: under torch.compile an
    evaluation compiles its own graph, and counted in, it read as a training step several times slower."""
    aside = [0.0]
    meter = Meter(SimpleNamespace(rows_per_batch=64), total_steps=100, first_step=0, aside=lambda: aside[0])
    meter.window(1)
    start = meter.mark
    time.sleep(0.6)
    aside[0] = 0.5  # half a second of that evaluating, the rest nine more steps
    rate, _ = meter.window(10)
    assert rate == pytest.approx(9 * 64 / max(meter.mark - start - 0.5, 1e-9))
    start = meter.mark
    time.sleep(0.3)
    aside[0] = 0.75
    rate, _ = meter.window(12)
    assert rate == pytest.approx(2 * 64 / max(meter.mark - start - 0.25, 1e-9))  # only what was aside since step 10


def test_the_recipes_own_metrics_follow_the_loss_in_the_step_lines_and_the_bar(caplog):
    """digits' train_step returns its accuracy beside the loss: metrics.jsonl had it, the lines a user reads did not."""
    import io
    import logging

    from rich.console import Console

    from launcher.runtime.progress import ProgressReporter

    with caplog.at_level(logging.INFO, logger="dlaunch"):
        ProgressReporter(40, True, Console(file=io.StringIO())).logged(20, 0.65, 31000.0, 1.0, {"accuracy": 0.895833})
    assert "step 20/40  loss 0.65  accuracy 0.895833  31000 ex/s  eta 1s" in caplog.text
    screen = io.StringIO()
    bar = ProgressReporter(40, True, Console(file=screen, force_terminal=True, width=150))
    bar.logged(20, 0.65, 31000.0, 1.0, {"accuracy": 0.895833})
    bar.close()
    assert "loss 0.65  accuracy 0.8958" in screen.getvalue()


_TORCH_WARNING = """
import logging, os, sys, tempfile
import torch.distributed as dist
from launcher.runtime.progress import untag_torch_logs
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1), rank=0, world_size=1)
if sys.argv[1] == "untag":
    untag_torch_logs()
import torch._logging
torch._logging.set_logs(recompiles=True)  # a recipe's own: torch sets its handlers up again
logging.getLogger("torch._dynamo").warning("recompile_limit reached\\nsecond line")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("untag", [False, True])
def test_a_workers_torch_warnings_lose_torchs_rank_tag_which_the_agent_adds_already(untag):
    """A rank's torch.compile warning read ``[rank1] [rank1]:W1201 ...`` on the terminal: the agent's tag, then the
    one torch's own log format adds once a process group exists."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_LOGS")}  # torch's default format
    out = subprocess.run([sys.executable, "-c", _TORCH_WARNING, "untag" if untag else "keep"], capture_output=True,
                         text=True, timeout=120, env=env)
    lines = [line for line in out.stderr.splitlines() if "recompile_limit" in line or "second line" in line]
    assert len(lines) == 2, out.stderr
    assert all(line.startswith("W") for line in lines) if untag else all(line.startswith("[rank0]:W") for line in lines)
