"""A CPU proxy for the GPU's pipelining: a step the loop does not log reads no tensor value on the host.

On a GPU, reading a value (``.item()``, ``float(t)``, ``bool(t)``: aten's ``_local_scalar_dense``) waits for
every kernel queued before it, so the host stops running ahead of the device: one such read per step costs the
launch time of the next step, on every step. The CPU runs the same ops, so counting that op here finds the
read on the CPU that would cost time on a GPU. The count of a 40-step run must equal a 20-step run's when
both log only their first and last steps: the steps in between add none. Not seen here: a copy to the host
(``.cpu()``, ``.tolist()``, ``.numpy()``), which dispatches nothing for a tensor already on the CPU.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.config.compose import compose_and_validate
from launcher.config.plan import Plan
from launcher.runtime.loop import train


class ValueReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (each one a device sync on a GPU).

    Reads inside torch's optimizers are left out: they keep their step counter on the host (a CPU tensor on a
    GPU too, unless ``capturable`` or ``fused``), so reading it waits for nothing. The learning-rate schedulers
    (``torch.optim.lr_scheduler``, which runs dlaunch's schedule) are counted.
    """

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default, torch.ops.aten.is_nonzero.default,
             torch.ops.aten.nonzero.default}
    OPTIMIZERS = os.path.dirname(torch.optim.__file__)

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS and not any(f.filename.startswith(self.OPTIMIZERS) and "lr_scheduler" not in f.filename
                                          for f in traceback.extract_stack()):
            self.count += 1
        return func(*args, **(kwargs or {}))


def reads_in_a_run(tmp_path, steps: int, *overrides: str) -> int:
    spec = compose_and_validate(["cluster.device=cpu", "strategy=one_device", f"trainer.steps={steps}",
                                 f"trainer.log_every={steps}", *overrides], 0)
    run_dir = tmp_path / f"run{steps}"
    run_dir.mkdir()
    with ValueReads() as reads:
        train(spec, None, run_dir, Plan.resolve(spec, 0))
    return reads.count


@pytest.mark.parametrize("options", [
    ("recipe=charlm", "recipe.sample_chars=0", "recipe.eval_windows=8", "input.global_batch_size=8", "recipe.context=32"),
    ("recipe=charlm", "recipe.sample_chars=0", "recipe.eval_windows=8", "input.global_batch_size=8", "recipe.context=32",
     "trainer.precision=bf16-mixed"),
    ("recipe=linear", "trainer.grad_accum_steps=2", "trainer.clip_grad_norm=1.0", "trainer.lr_schedule.decay=cosine",
     "trainer.lr_schedule.warmup_steps=5", "trainer.checkpoint.every_steps=1000"),
], ids=["charlm", "charlm-bf16", "linear-accum-clip-schedule"])
def test_steps_the_loop_does_not_log_read_no_value_on_the_host(tmp_path, options):
    short, long = reads_in_a_run(tmp_path, 20, *options), reads_in_a_run(tmp_path, 40, *options)
    assert long == short, f"{(long - short) / 20:.2f} value reads per unlogged step ({short} in 20 steps, {long} in 40)"
