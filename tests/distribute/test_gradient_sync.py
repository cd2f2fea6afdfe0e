"""``strategy.no_sync``: accumulation with one gradient sync per step, and the step it refuses, in real gloo processes.

The last micro-batch inside ``no_sync`` is the mistake no other error shows: under DDP each rank
steps on its own gradients and the replicas drift apart; under FSDP2 that backward's gradients
miss the sharded parameters. The optimizer's step raises ``UnsyncedStep`` instead; the right forms
(the last micro-batch outside it), a step with no backward, and ``check=False`` (a script that
averages the gradients itself) step as before.
"""

from __future__ import annotations

import pytest
import torch

from launcher.launch.function import WorkerFailed, run_function

pytestmark = pytest.mark.slow

PATTERNS = ("last_outside", "enabled_not_last", "metric_forward", "all_inside", "last_inside", "no_backward",
            "synced_by_hand")


def accumulate(strategy_name: str, pattern: str) -> dict:
    """Two steps of two micro-batches each, rank-dependent data; the parameters' sum after them."""
    import torch.distributed as dist

    from launcher import distribute as dl
    from launcher.distribute.gradient_sync import UnsyncedStep
    from launcher.strategies.impl.fsdp import FSDPStrategy

    strategy = FSDPStrategy(device_type="cpu") if strategy_name == "fsdp" else dl.MirroredStrategy(devices=["cpu"])
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rank = dist.get_rank()
    try:
        for step in range(2):
            for i in range(2):
                x = torch.full((3, 4), float(rank + i + step))
                last = i == 1
                if pattern in ("last_outside", "metric_forward") and last:
                    model(x).pow(2).mean().backward()
                    if pattern == "metric_forward":  # a train-mode forward for a number alone, not backpropagated
                        with strategy.no_sync(model):
                            model(x).sum().item()
                    continue
                if pattern == "last_inside" and not last:  # synced, then the last one not: as wrong as all inside
                    model(x).pow(2).mean().backward()
                    continue
                if pattern == "no_backward" and step == 1:  # a skipped batch: no backward at all before the step
                    with strategy.no_sync(model):
                        model(x).sum().item()
                    continue
                with strategy.no_sync(model, enabled=not last if pattern in ("enabled_not_last", "no_backward") else True,
                                      check=pattern != "synced_by_hand"):
                    model(x).pow(2).mean().backward()
            if pattern == "synced_by_hand":  # every backward unsynced, then the average taken by the script
                for p in model.parameters():
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            optimizer.step()
            optimizer.zero_grad()
    except UnsyncedStep as exc:
        return {"error": str(exc)}
    total = sum(float(p.full_tensor().sum() if hasattr(p, "full_tensor") else p.sum()) for p in model.parameters())
    return {"sum": total}


@pytest.mark.parametrize("strategy_name", ["mirrored", "fsdp"])
def test_a_step_whose_last_backward_skipped_the_sync_is_refused_and_the_right_forms_agree(strategy_name):
    patterns = [p for p in PATTERNS if strategy_name == "mirrored" or p != "synced_by_hand"]  # FSDP2: no .grad to sync
    results = {pattern: run_function(accumulate, args=(strategy_name, pattern), device="cpu", nproc=2)
               for pattern in patterns}
    right = [results[p][r]["sum"] for p in ("last_outside", "enabled_not_last", "metric_forward") for r in (0, 1)]
    assert right == pytest.approx([right[0]] * 6, rel=1e-6)  # one sync per step: every rank the same model
    if strategy_name == "mirrored":  # check=False: the script's own all-reduce, the same average
        assert [results["synced_by_hand"][r]["sum"] for r in (0, 1)] == pytest.approx(right[:2], rel=1e-6)
    # a step without a backward steps on nothing, no_sync or not: not refused, and every rank agrees
    assert results["no_backward"][0]["sum"] == pytest.approx(results["no_backward"][1]["sum"], rel=1e-6)
    for pattern in ("all_inside", "last_inside"):
        for rank in (0, 1):
            error = results[pattern][rank]["error"]
            assert "optimizer.step() after a backward inside strategy.no_sync(model)" in error
            assert ("drift apart" if strategy_name == "mirrored" else "leave them out") in error
            assert "enabled=not last" in error and "check=False" in error


def test_where_nothing_is_synced_no_sync_is_nothing_and_never_refuses(strategy):
    """Replica threads of one process share their gradients: no_sync changes nothing there, and checks nothing, even
    on a step whose every backward ran inside it."""
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [r.weight.detach().clone() for r in model.replicas]

    def step(x):
        with strategy.no_sync(model):
            model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    strategy.run(step, args=(torch.ones(2, 2),))
    assert all(not torch.equal(r.weight.detach(), b) for r, b in zip(model.replicas, before))
