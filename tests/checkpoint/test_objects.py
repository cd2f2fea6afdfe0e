"""A recipe's own objects (Parts.objects) in its checkpoints: saved by every rank, restored on resume, refused early."""

from __future__ import annotations

import pytest
import torch

from launcher.checkpoint import layout, read_object
from launcher.checkpoint import objects as saved_objects
from launcher.distribute.extended import StrategyExtended
from tests.conftest import FIXTURES, dlaunch

EMA = FIXTURES / "ema_recipe.py"


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(), ("strategy=mirrored", "cluster=1x2")])
def test_a_resumed_recipe_finds_its_moving_average_as_it_was(run_dlaunch, tmp_path, shape):
    """6 steps straight, against 3 steps then `dlaunch resume RUN_DIR trainer.steps=6`: the same EMA at step 6 (torch's
    AveragedModel, which torch's optimizer step hook updates once a step, micro-batches or not), in one process and in
    each of two."""
    common = (f"recipe.entry={EMA}", "trainer.checkpoint.every_steps=3", "trainer.grad_accum_steps=2", *shape)
    proc, straight = run_dlaunch(*common, "trainer.steps=6", name="straight")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, stopped = run_dlaunch(*common, "trainer.steps=3", name="stopped")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = dlaunch("resume", str(stopped), "trainer.steps=6", cwd=tmp_path, device=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if shape:  # mirrored 1x2: DDP's replicas hold the same EMA, which the checkpoint holds once; rank 1 a mark
        from launcher.checkpoint.safe import SafeReader

        keys = SafeReader(str(layout.step_dir(stopped / "checkpoints", 6))).read_metadata().state_dict_metadata
        assert sorted(k for k in keys if k.startswith("objects.")) == ["objects.rank0.ema", "objects.rank1.ema.rank0"]
    for rank in range(2 if shape else 1):  # each rank's, read back
        a = read_object(layout.step_dir(straight / "checkpoints", 6), "ema", rank)
        b = read_object(layout.step_dir(stopped / "checkpoints", 6), "ema", rank)
        assert int(a["n_averaged"]) == 6 and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _KeepsItsOwn(StrategyExtended):
    def save_checkpoint(self, model, path, progress) -> bool:  # parameter servers: on their ps tasks
        return True


def test_objects_are_refused_before_the_first_step_where_no_checkpoint_could_hold_them():
    ema = torch.optim.swa_utils.AveragedModel(torch.nn.Linear(2, 1))
    with pytest.raises(TypeError, match=r"Parts.objects \(ema\): this strategy saves its variables itself"):
        saved_objects.checked({"ema": ema}, _KeepsItsOwn(["cpu:0"]), rank=0, saving=True)
    assert saved_objects.checked({"ema": ema}, StrategyExtended(["cpu:0"]), rank=0, saving=True) == {"ema": ema}

    class NumpyState:
        def state_dict(self):
            import numpy as np

            return {"rng": np.random.get_state()}

        def load_state_dict(self, state):
            raise AssertionError("never")

    with pytest.raises(TypeError, match="holds more than tensors and plain data"):
        saved_objects.checked({"sampler": NumpyState()}, None, rank=0, saving=True)
    on_meta = torch.optim.swa_utils.AveragedModel(torch.nn.Linear(2, 1, device="meta"))  # init_from=rank0, rank 1
    with pytest.raises(TypeError, match="tensors on the meta device, which hold no values"):
        saved_objects.checked({"ema": on_meta}, None, rank=1, saving=True)
    assert saved_objects.checked({"sampler": NumpyState()}, None, rank=0, saving=False)  # no checkpoints: no need


def test_a_recipe_whose_parts_name_an_object_badly_is_told_which():
    from launcher.runtime.recipe import Parts, RecipeContractError, checked_parts

    parts = Parts(model=torch.nn.Linear(1, 1), optimizer=None, train_data=[], objects={"ema": torch.zeros(1)})
    with pytest.raises(RecipeContractError, match=r"returned Parts with objects\['ema'\]: a Tensor has no state_dict"):
        checked_parts(parts, build=_a_build)


def _a_build():
    """Stands for a recipe's build() in the message."""


def test_read_object_names_what_a_checkpoint_holds_when_the_name_is_not_there(tmp_path):
    from launcher.checkpoint import CheckpointError
    from launcher.checkpoint.scripts import ScriptCheckpoints

    model = torch.nn.Linear(2, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    path = ScriptCheckpoints(tmp_path).save(1, model, objects={"scaler": scaler})
    assert read_object(path, "scaler")["scale"] == 8.0
    with pytest.raises(CheckpointError, match=r"has no object 'ema' of rank 0 \(it has: objects.rank0.scaler\)"):
        read_object(path, "ema")


def test_the_docs_show_the_recipe_that_the_test_runs():
    from tests.conftest import ROOT

    assert EMA.read_text().strip() in (ROOT / "docs" / "RECIPES.md").read_text()


class _Count:
    """A state of its own on each rank (a sampler's position, say): never shared."""

    def __init__(self, n):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _save_and_restore(root: str) -> dict:
    import torch.distributed as dist

    from launcher.checkpoint.safe import SafeReader
    from launcher.checkpoint.scripts import ScriptCheckpoints

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    ema = torch.optim.swa_utils.AveragedModel(model)  # the same on every rank, as under DDP
    ckpt = ScriptCheckpoints(root)
    path = ckpt.save(1, model, objects={"ema": ema, "count": _Count(10 + rank)})
    keys = sorted(k for k in SafeReader(str(path)).read_metadata().state_dict_metadata if k.startswith("objects."))
    fresh_ema, count = torch.optim.swa_utils.AveragedModel(torch.nn.Linear(3, 1)), _Count(0)
    ckpt.restore(torch.nn.Linear(3, 1), objects={"ema": fresh_ema, "count": count})
    same = all(torch.equal(a, b) for a, b in zip(fresh_ema.state_dict().values(), ema.state_dict().values()))
    read_back = read_object(path, "ema", rank)["module.weight"]
    try:
        ckpt.save(2, model, objects={"count": _Count(object() if rank == 1 else 1)})
        refused = ""
    except TypeError as exc:
        refused = str(exc)
    return {"keys": keys, "same": same, "count": count.n, "weight": read_back, "refused": refused}


@pytest.mark.slow
def test_a_state_every_rank_holds_alike_is_saved_once_and_each_rank_gets_its_own_back(tmp_path):
    """Under DDP every rank's EMA is the same: rank 1 saves a mark, not a second copy, and a restore follows it. A
    state of rank 1's own is saved as its own. A state one rank cannot save stops every rank with the cause."""
    from launcher.launch.function import run_function

    results = run_function(_save_and_restore, args=(str(tmp_path),), device="cpu", nproc=2)
    assert results[0]["keys"] == ["objects.rank0.count", "objects.rank0.ema", "objects.rank1.count", "objects.rank1.ema.rank0"]
    assert [results[r]["count"] for r in (0, 1)] == [10, 11] and all(results[r]["same"] for r in (0, 1))
    assert torch.equal(results[0]["weight"], results[1]["weight"])
    assert "objects['count']: its state_dict() holds more than tensors" in results[1]["refused"]
    assert results[0]["refused"].startswith("rank 1 could not save its objects: objects['count']")
    assert not layout.step_dir(tmp_path, 2).exists()  # nothing of step 2 was written
