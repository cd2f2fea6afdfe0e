"""The worker's side in one process: what is saved, what a restart resumes from, what is refused."""

from __future__ import annotations

import pytest
import torch

from launcher import checkpoint
from launcher.checkpoint import Checkpointer, CheckpointError, layout
from launcher.cli.main import main
from launcher.config.compose import compose_and_validate
from launcher.input.position import Position


def spec_for(*overrides):
    return compose_and_validate(["trainer.checkpoint.every_steps=5", "trainer.steps=20", *overrides], cuda_devices=0)


def model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.Adam(model.parameters())


def test_save_then_load_restores_model_optimizer_rng_and_position(tmp_path):
    model, opt = model_and_optimizer()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ckpt = Checkpointer(spec_for(), tmp_path, rank=0)
    path = ckpt.save(7, Position(1, 2), model, opt)
    expected = torch.rand(4)  # the RNG continues from the saved state after a load
    other, other_opt = model_and_optimizer(seed=1)
    step, position = Checkpointer(spec_for(), tmp_path, rank=0).load(path, other, other_opt)
    assert (step, position) == (7, Position(1, 2))
    assert torch.equal(other.weight, model.weight)
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(4), expected)


def test_the_same_step_is_saved_once(tmp_path):
    model, opt = model_and_optimizer()
    ckpt = Checkpointer(spec_for(), tmp_path, rank=0)
    first = ckpt.save(5, Position(0, 5), model, opt)
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert ckpt.save(5, Position(0, 5), model, opt) == first  # a stop signal right after a scheduled save
    assert (first / "manifest.json").stat().st_mtime_ns == stamp


def test_a_restart_resumes_from_the_runs_newest_checkpoint_whatever_it_started_from(tmp_path):
    """Once this command's checkpoints began (``start``: another timeline's later steps set aside); before that, a
    restart resumes as the first attempt did (the directory may hold another run's steps)."""
    model, opt = model_and_optimizer()
    never = spec_for("trainer.resume=never")
    Checkpointer(spec_for(), tmp_path, rank=0).save(10, Position(0, 10), model, opt)  # an earlier command's
    assert checkpoint.find(never, tmp_path) is None
    assert checkpoint.find(never, tmp_path, restarted=True) is None
    ckpt = Checkpointer(spec_for(), tmp_path, rank=0)
    ckpt.start(0)
    assert not (tmp_path / "checkpoints" / "step-00000010").exists()  # set aside
    assert checkpoint.find(never, tmp_path, restarted=True) is None  # began, saved nothing yet
    ckpt.save(4, Position(0, 4), model, opt)
    assert checkpoint.find(never, tmp_path) is None
    assert checkpoint.find(never, tmp_path, restarted=True) == layout.step_dir(tmp_path / "checkpoints", 4)


def test_a_restart_before_this_command_saved_does_not_take_an_older_runs_earlier_step(tmp_path):
    """A fine-tune from another run's step 50 in a directory that holds an older run's step 10 (earlier: not set
    aside): a restart before the fine-tune's first save resumes from step 50 again, not from step 10."""
    model, opt = model_and_optimizer()
    Checkpointer(spec_for(), tmp_path / "other", rank=0).save(50, Position(0, 50), model, opt)
    Checkpointer(spec_for(), tmp_path, rank=0).save(10, Position(0, 10), model, opt)
    start = layout.step_dir(tmp_path / "other" / "checkpoints", 50)
    tune = spec_for(f"trainer.resume={start}", "trainer.steps=70")
    Checkpointer(tune, tmp_path, rank=0).start(50)
    assert checkpoint.find(tune, tmp_path, restarted=True) == start


def test_a_checkpoint_past_trainer_steps_is_refused(tmp_path):
    model, opt = model_and_optimizer()
    Checkpointer(spec_for(), tmp_path, rank=0).save(10, Position(0, 10), model, opt)
    with pytest.raises(CheckpointError, match="past trainer.steps=8"):
        checkpoint.find(spec_for("trainer.steps=8"), tmp_path)


def test_a_checkpoint_dir_that_cannot_be_made_is_a_config_error(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = main(["trainer.checkpoint.every_steps=5", f"trainer.checkpoint.dir={blocker}", "launch.dry_run=true",
                 f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "trainer.checkpoint.dir" in err and "Traceback" not in err


def test_a_renamed_module_is_named_both_ways_when_a_load_fails(tmp_path):
    """A module renamed in the recipe (blocks -> layers): the error named the first missing key alone, which read as
    a setting that changed; both sides' names show the rename."""
    def model(name):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.ModuleDict({name: torch.nn.Linear(4, 4)}), torch.nn.ModuleDict({"head": torch.nn.Linear(4, 1)}))

    saved = model("blocks")
    path = Checkpointer(spec_for(), tmp_path, rank=0).save(5, Position(0, 5), saved, torch.optim.SGD(saved.parameters(), lr=0.1))
    renamed = model("layers")
    with pytest.raises(CheckpointError) as caught:
        Checkpointer(spec_for(), tmp_path, rank=0).load(path, renamed, torch.optim.SGD(renamed.parameters(), lr=0.1))
    assert ("; the model has 0.layers.bias, 0.layers.weight that the checkpoint lacks, and the checkpoint holds "
            "0.blocks.bias, 0.blocks.weight that the model lacks (a module renamed?); did a recipe setting") in str(caught.value)
