"""A script under a strategy of several processes that never syncs its model's copies, or never lets fsdp shard it, is
told so."""

from __future__ import annotations

import pytest

from tests.runtime.test_script import _run

pytestmark = pytest.mark.slow

UNSYNCED = """
import torch
from launcher import distribute as dl

strategy = dl.get_strategy()
with strategy.scope():
    model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # never given to strategy.prepare(), nor wrapped in DDP
for _ in range(3):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_script_whose_copies_are_never_synced_is_told_so_at_its_first_step(tmp_path):
    """Under mirrored across processes, a model neither prepared nor wrapped in DDP trained one copy per process,
    never synced, exit 0 and no word. A torchrun script's own DDP is synced: nothing said there (the test below)."""
    (tmp_path / "unsynced.py").write_text(UNSYNCED)
    proc, _ = _run(tmp_path, "script=unsynced.py", "strategy=mirrored", "cluster=1x2")
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert text.count("strategy=mirrored: the script's model was neither given to strategy.prepare(model, optimizer) "
                      "nor wrapped in DistributedDataParallel, so each of the 2 processes trains its own copy") == 1, text
    assert "FutureWarning" not in text, text  # the look for DDP over every live object read torch's deprecated reduce_op


def test_a_script_that_trains_a_model_fsdp_never_sharded_is_told_so_once_and_its_precision_at_its_first_step(tmp_path):
    """Under fsdp the same script trains (its copies unsynced, each on its own data), but nothing is sharded: the plan's
    strategy would be a label only. A script with no optimizer step is not told (tests/runtime/test_script.py)."""
    (tmp_path / "unsharded.py").write_text(UNSYNCED)
    proc, _ = _run(tmp_path, "script=unsharded.py", "strategy=fsdp", "cluster=1x2", "trainer.precision=bf16-mixed")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert text.count("strategy=fsdp: the script never called strategy.prepare(model, optimizer), so its model did "
                      "not get FSDP2's sharding (fully_shard)") == 1, text[-3000:]
    # a torchrun script's optimizer is not prepared either: its unused precision was told at its end, hours late
    assert text.count("trainer.precision=bf16-mixed: after its first optimizer step, the script has not entered") == 1
    assert text.count("has not entered") == 1, text[-3000:]
