"""Strategy.prepare's checks that hold under every strategy (launcher/distribute/strategy.py)."""

from __future__ import annotations

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
                                                ({"lr_": 0.01}, "lr_", "lr")])
def test_a_parameter_groups_mistyped_key_is_refused_with_what_was_meant(group, typo, meant):
    """torch.optim keeps an unknown group key unused: the head trained at the base lr, the norms with weight decay."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), **group}],
                                  lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match=rf"parameter group 1 of AdamW has '{typo}', which it does not know "
                                         rf"\(did you mean '{meant}'\?\)"):
        dl.OneDeviceStrategy("cpu:0").prepare(model, optimizer)


def test_a_groups_own_keys_unlike_the_optimizers_are_kept():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD([{"params": model.parameters(), "lr_mult": 0.1, "label": "head"}], lr=0.1)
    dl.OneDeviceStrategy("cpu:0").prepare(model, optimizer)
