"""The learning-rate schedule (launcher/runtime/schedule.py): warm-up and decay, torch's LambdaLR, the lr a step
used, and its place in a checkpoint (launcher/runtime/step.py's loop state)."""

from __future__ import annotations

import pytest
import torch

from launcher.config.trainer import ScheduleSpec, TrainerSpec
from launcher.runtime.schedule import ScheduleFactor, current_lr, make_schedule
from launcher.runtime.step import ReplicaStep, loop_state, restore_loop_state
from tests.runtime.test_step import model_and_batch, mse_step


def test_the_schedule_warms_up_then_decays_to_its_floor():
    cosine = ScheduleFactor(ScheduleSpec(decay="cosine", warmup_steps=4, min_lr_ratio=0.1), total_steps=14)
    assert [cosine(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine(4) == 1.0 and cosine(9) == pytest.approx(0.55) and cosine(14) == pytest.approx(0.1)
    assert cosine(40) == pytest.approx(0.1)  # after the decay: the floor
    linear = ScheduleFactor(ScheduleSpec(decay="linear", decay_steps=10), total_steps=100)
    assert [linear(s) for s in (0, 5, 10, 50)] == [1.0, 0.5, 0.0, 0.0]


def test_a_constant_schedule_makes_no_scheduler_and_others_use_torchs():
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.5)
    assert make_schedule(TrainerSpec(), optimizer) is None
    schedule = make_schedule(TrainerSpec(steps=10, lr_schedule=ScheduleSpec(decay="linear")), optimizer)
    assert isinstance(schedule, torch.optim.lr_scheduler.LambdaLR)
    optimizer.step()
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * 0.9)


@pytest.mark.parametrize("steps", [4, 8])
def test_a_resume_takes_the_lr_of_its_own_schedule_at_the_saved_position(steps):
    """Saved after 4 of 4 cosine steps (lr 0 next); resumed with trainer.steps=8, step 5 uses the 8-step schedule's
    lr (half of it), not the saved 0; resumed with the same schedule, the saved lr bit for bit."""
    import types

    spec = lambda n: TrainerSpec(steps=n, lr_schedule=ScheduleSpec(decay="cosine"))  # noqa: E731
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    schedule = make_schedule(spec(4), optimizer)
    for _ in range(4):
        optimizer.step()
        schedule.step()
    saved, saved_optimizer = loop_state(schedule, types.SimpleNamespace(scaler=None)), optimizer.state_dict()
    resumed = torch.optim.SGD(model.parameters(), lr=0.05)
    later = make_schedule(spec(steps), resumed)
    resumed.load_state_dict(saved_optimizer)
    restore_loop_state(saved, later, types.SimpleNamespace(scaler=None, optimizer=resumed, recipe_groups=[]), 4)
    expected = optimizer.param_groups[0]["lr"] if steps == 4 else 0.05 * ScheduleFactor(spec(8).lr_schedule, 8)(4)
    assert resumed.param_groups[0]["lr"] == expected and later.get_last_lr() == [expected]
    assert steps == 4 or expected == pytest.approx(0.025)
    constant = torch.optim.SGD(model.parameters(), lr=0.05)  # resumed with no schedule: the lr, not the decayed 0
    constant.load_state_dict(saved_optimizer)
    assert constant.param_groups[0]["lr"] == 0.0
    restore_loop_state(saved, None, types.SimpleNamespace(scaler=None, optimizer=constant, recipe_groups=[{"lr": 0.05}]), 4)
    assert constant.param_groups[0]["lr"] == 0.05


def test_fp16_skipping_its_first_updates_does_not_make_torch_warn_about_the_schedule():
    """GradScaler skips the first updates (scale too high), so torch sees lr_scheduler.step() before any
    optimizer.step() and warns on every rank; under fp16-mixed that is how training starts, not a mistake."""
    import warnings

    def exploding(model, batch):
        return mse_step(model, batch) * 1e6

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = TrainerSpec(precision="fp16-mixed", steps=4, lr_schedule=ScheduleSpec(decay="linear"))
        model, batch = model_and_batch()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        schedule = make_schedule(trainer, optimizer)
        step = ReplicaStep(exploding, model, optimizer, trainer, "cpu", manual=False)
        for _ in range(2):
            step(batch, measure=True)
            schedule.step()
    assert float(step.skipped) == 2.0
    assert not [w for w in seen if "lr_scheduler.step()" in str(w.message)]


def test_each_parameter_group_training_at_its_own_rate_has_its_lr_logged():
    """A fine-tune's head at 10x the body's rate: only the first group's lr was logged, so a sweep over the head's lr
    charted one curve per job, all alike."""
    body, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD([{"params": body.parameters()}, {"params": head.parameters(), "lr": 0.1}], lr=0.01)
    assert current_lr(optimizer) == {"lr": 0.01, "lr_group1": 0.1}
    schedule = make_schedule(TrainerSpec(steps=4, lr_schedule=ScheduleSpec(decay="linear")), optimizer)
    for _ in range(4):
        optimizer.step()
        schedule.step()
    assert current_lr(optimizer) == {"lr": 0.0, "lr_group1": 0.0}  # at the end both reach 0: still two keys
    same = torch.optim.SGD([{"params": body.parameters()}, {"params": head.parameters(), "weight_decay": 0.0}], lr=0.01)
    assert current_lr(same) == {"lr": 0.01}  # groups apart for their weight decay only: one rate
