"""A process SIGKILLed in the middle of a save leaves ``latest`` on a complete, readable checkpoint."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from launcher.checkpoint import layout, read_tensors

pytestmark = pytest.mark.slow

SAVER = """
import sys, time, torch
from pathlib import Path
from launcher.checkpoint import Checkpointer, layout
from launcher.config.compose import compose_and_validate
from launcher.input.position import Position

run_dir = Path(sys.argv[1])
spec = compose_and_validate(["trainer.checkpoint.every_steps=1"], cuda_devices=0)
ckpt = Checkpointer(spec, run_dir, rank=0)
small = torch.nn.Linear(4, 1)
torch.nn.init.constant_(small.weight, 0.5)
ckpt.save(1, Position(0, 1), small, torch.optim.SGD(small.parameters(), lr=0.1))
print("saved 1", flush=True)
# the kill must land before the second save commits, however late the test gets to send it: hold the commit
layout.commit = lambda *args, **kwargs: time.sleep(3600)
big = torch.nn.Linear(8192, 6144)  # about 200 MB to write: slow enough to be killed midway
ckpt.save(2, Position(0, 2), big, torch.optim.SGD(big.parameters(), lr=0.1))
print("saved 2", flush=True)
"""


def test_a_save_killed_midway_never_moves_latest(tmp_path):
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        partial = layout.partial_dir(root, 2)
        deadline = time.monotonic() + 120
        # killed as soon as its first file shows (often midway through writing it), at the latest before the commit
        while not (partial.is_dir() and any(partial.glob("*.distcp"))):
            assert proc.poll() is None and time.monotonic() < deadline, "the second save should be under way"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "saved 2" not in proc.stdout.read()
    assert (root / "latest").read_text().strip() == "step-00000001"
    assert layout.latest(root) == layout.step_dir(root, 1)
    assert torch.equal(read_tensors(layout.latest(root))["weight"], torch.full((1, 4), 0.5))
    assert partial.exists() and not layout.step_dir(root, 2).exists()
    layout.clean_partials(root)  # what the next run does before its first save
    assert not partial.exists()
