"""Strategy.prepare's checks that hold under every strategy (launcher/distribute/strategy.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from launcher import distribute as dl


@pytest.mark.parametrize("make", [
    lambda: dl.OneDeviceStrategy("cpu:0"),
    lambda: dl.MirroredStrategy(["cpu:0", "cpu:1"]),
    lambda: dl.experimental.CentralStorageStrategy(["cpu:0", "cpu:1"], "cpu:0"),
], ids=["one_device", "mirrored", "central_storage"])
def test_an_optimizer_over_frozen_parameters_only_is_refused_with_one_message(make):
    """A fine-tune that froze everything: one_device failed at the first backward ("was it detached ...?"), mirrored
    processes on DDP's own refusal, with no line of the user's code."""
    strategy = make()
    with strategy.scope():
        model = torch.nn.Linear(4, 2).requires_grad_(False)
        with pytest.raises(ValueError, match=r"none of the 2 parameter tensors the optimizer holds requires grad"):
            strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_frozen_model_beside_a_trained_head_and_a_frozen_teacher_prepared_alone_are_fine():
    strategy = dl.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        body, head = torch.nn.Linear(4, 4).requires_grad_(False), torch.nn.Linear(4, 2)
        model = torch.nn.Sequential(body, head)
        strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        strategy.prepare(torch.nn.Linear(4, 4).requires_grad_(False))  # a teacher: no optimizer


@pytest.mark.parametrize("group, typo, meant", [({"weight_decy": 0.0}, "weight_decy", "weight_decay"),
                                                ({"lr_": 0.01}, "lr_", "lr"), ({"mometnum": 0.5}, "mometnum", "momentum")])
def test_a_parameter_groups_mistyped_key_is_said_with_what_was_meant(group, typo, meant, caplog):
    """torch.optim keeps an unknown group key unused: the head trained at the base lr, the norms with weight decay."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), **group}],
                                lr=1e-3, momentum=0.9, weight_decay=0.1)
    with caplog.at_level(logging.WARNING, logger="dlaunch"):
        dl.OneDeviceStrategy("cpu:0").prepare(model, optimizer)
    assert f"parameter group 1 of SGD has '{typo}', which it does not know (did you mean '{meant}'?)" in caplog.text


def test_keys_of_its_own_and_those_torchs_schedulers_write_are_not_said(caplog):
    """OneCycleLR over SGD writes max_momentum and base_momentum into every group (a first version, matching keys
    loosely, refused the linear recipe with such a schedule)."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD([{"params": model.parameters(), "lr_mult": 0.1, "label": "head", "names": ["w"]}], lr=0.1,
                                momentum=0.9)
    torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    with caplog.at_level(logging.WARNING, logger="dlaunch"):
        dl.OneDeviceStrategy("cpu:0").prepare(model, optimizer)
    assert "does not know" not in caplog.text
