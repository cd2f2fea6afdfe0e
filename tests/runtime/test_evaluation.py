"""The recipe's ``evaluate`` under the run's precision (launcher/runtime/evaluation.py)."""

from __future__ import annotations

import types

import torch

from launcher.runtime.evaluation import Evaluator
from launcher.runtime.step import ReplicaStep


def test_a_weight_changed_in_place_during_an_evaluation_is_the_one_evaluated():
    """bf16-mixed: one autocast region spans the evaluation, and torch's cache of each weight's bf16 cast outlived
    an EMA swapped in with copy_: its evaluation gave the old weights' loss (a new-user pass, EMA under mesh)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    x = torch.randn(16, 8)
    ema = {name: p.detach() * 0.5 + 0.1 for name, p in model.named_parameters()}

    def evaluate(module, parts):
        before = module(x).float().pow(2).mean().item()
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(ema[name])  # the EMA's values swapped in
        return {"before": before, "ema": module(x).float().pow(2).mean().item()}

    step = types.SimpleNamespace(precision="bf16-mixed", device_type="cpu")
    step.autocast = lambda cache=True: ReplicaStep.autocast(step, cache)
    found = Evaluator(evaluate, model, None, step, chief=True, everywhere=False)()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x).float().pow(2).mean().item()  # the EMA's weights, in a fresh region
    assert found["ema"] == expected and found["ema"] != found["before"], found


def test_what_an_evaluation_draws_leaves_the_training_generators_as_they_were():
    """A DataLoader's iter() draws its seed from torch's generator, a random subset draws more: without the fork,
    training after an evaluation went on from other random numbers, so eval_every changed its dropout masks."""
    import random

    import numpy as np

    def evaluate(module, parts):
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4)
        list(loader)
        return {"drawn": torch.rand(()).item() + random.random() + float(np.random.rand())}

    step = types.SimpleNamespace(precision="fp32", device_type="cpu")
    step.autocast = lambda cache=True: ReplicaStep.autocast(step, cache)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = (torch.rand(3), random.random(), np.random.rand())
    evaluator = Evaluator(evaluate, torch.nn.Linear(2, 1), None, step, chief=True, everywhere=False)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    evaluator()
    after = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(after[0], expected[0]) and after[1:] == expected[1:]
