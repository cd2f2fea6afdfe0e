"""On a GPU: a one_device CUDA run stopped and resumed ends bitwise equal to one that never stopped.

The CUDA RNG state travels in the checkpoint too. Skips cleanly without a GPU (CI has none).
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint.test_resume import COMMON, assert_bitwise_equal, final_state, losses

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = ("strategy=one_device", "cluster.device=cuda")


def test_cuda_resume_is_bitwise_equal(run_dlaunch):
    dirs = {}
    for name, steps in (("straight", 30), ("stopped", 17), ("stopped", 30)):
        proc, dirs[name] = run_dlaunch(*COMMON, *CUDA, f"trainer.steps={steps}", name=name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cuda" in (dirs["straight"] / "summary.json").read_text()
    for a, b in zip(final_state(dirs["straight"]), final_state(dirs["stopped"])):
        assert_bitwise_equal(a, b)
    assert losses(dirs["straight"]) == losses(dirs["stopped"])


def test_cuda_checkpoint_holds_the_cuda_rng(tmp_path):
    from launcher.checkpoint import state

    torch.cuda.init()
    rng = state.rng_state()
    assert "cuda0" in rng and rng["cuda0"].dtype == torch.uint8
    expected = torch.rand(3, device="cuda")
    state.set_rng_state(rng)
    assert torch.equal(torch.rand(3, device="cuda"), expected)


def test_a_recipes_objects_on_cuda_resume_as_they_were(run_dlaunch, tmp_path):
    """Parts.objects loads onto the CPU and each load_state_dict places it: an AveragedModel of CUDA weights."""
    from launcher.checkpoint import layout
    from launcher.checkpoint import read_object
    from tests.checkpoint.test_objects import EMA
    from tests.conftest import dlaunch

    common = (f"recipe.entry={EMA}", "trainer.checkpoint.every_steps=3", *CUDA)
    dirs = {}
    for name, steps in (("straight", 6), ("stopped", 3)):
        proc, dirs[name] = run_dlaunch(*common, f"trainer.steps={steps}", name=name, device="cuda")
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = dlaunch("resume", str(dirs["stopped"]), "trainer.steps=6", cwd=tmp_path, device=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (read_object(layout.step_dir(dirs[n] / "checkpoints", 6), "ema") for n in ("straight", "stopped"))
    assert int(a["n_averaged"]) == 6 and all(torch.equal(a[k], b[k]) for k in a)
