"""The replica step (launcher/runtime/step.py) in one process: accumulation, clipping, fp16 skips, uneven shares."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

from launcher.config.trainer import TrainerSpec
from launcher.runtime.step import ReplicaStep, StepError, split_batch


def mse_step(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def model_and_batch(seed: int = 0, rows: int = 16):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(rows, 6, generator=g), torch.randn(rows, 1, generator=g))


def run_steps(trainer: TrainerSpec, steps: int = 3, user_step=mse_step, rows: int = 16):
    model, batch = model_and_batch(rows=rows)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ReplicaStep(user_step, model, optimizer, trainer, "cpu", manual=False)
    metrics = [step(batch, measure=True) for _ in range(steps)]
    return model, metrics, step


def test_accumulated_micro_batches_give_the_full_batch_update():
    full, full_metrics, _ = run_steps(TrainerSpec())
    accumulated, acc_metrics, _ = run_steps(TrainerSpec(grad_accum_steps=4))
    for a, b in zip(full.parameters(), accumulated.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # a sum in another order: rounding only
    torch.testing.assert_close(full_metrics[0][0], acc_metrics[0][0], rtol=1e-6, atol=0)  # the mean loss


def accumulate_under_fsdp() -> dict:
    """One rank of FSDP2 over 2 gloo processes: 2 steps of 4 micro-batches, against 2 steps without accumulation;
    how many reduce-scatters each made (FSDP2 calls torch.distributed's reduce_scatter_single, or _tensor)."""
    import torch.distributed as dist

    from launcher.strategies.fsdp import FSDPStrategy

    calls = []
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    strategy, found = FSDPStrategy(device_type="cpu"), {}
    for accum in (1, 4):
        model, batch = model_and_batch(rows=32)  # the same model on both ranks; each rank its 16 rows of the batch
        batch = tuple(t[16 * dist.get_rank():16 * (dist.get_rank() + 1)] for t in batch)
        with strategy.scope():
            model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        step, calls[:] = ReplicaStep(mse_step, model, optimizer, TrainerSpec(grad_accum_steps=accum), "cpu", manual=False), []
        losses = [float(step(batch)) for _ in range(2)]
        found[accum] = {"reduce_scatters": len(calls), "losses": losses,
                        "params": [p.full_tensor().detach() for p in model.parameters()]}
    return found


@pytest.mark.slow
def test_fsdp_accumulation_reduce_scatters_once_per_step_and_trains_as_without_it():
    from launcher.launch.function import run_function

    for found in run_function(accumulate_under_fsdp, nproc=2, device="cpu").values():
        assert found[1]["reduce_scatters"] == 2 and found[4]["reduce_scatters"] == 2  # one per step: the last micro-batch's
        torch.testing.assert_close(found[1]["losses"], found[4]["losses"], rtol=1e-6, atol=0)
        for whole, micro in zip(found[1]["params"], found[4]["params"]):
            torch.testing.assert_close(whole, micro, rtol=1e-6, atol=1e-7)  # a sum in another order: rounding only


def test_clipping_bounds_the_update_and_reports_the_norm_before_it():
    model, batch = model_and_batch()
    before = [p.detach().clone() for p in model.parameters()]
    mse_step(model, batch).backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    model.zero_grad()
    clipped, metrics, _ = run_steps(TrainerSpec(clip_grad_norm=0.01), steps=1)
    assert float(metrics[0][1]) == pytest.approx(norm, rel=1e-5)
    moved = math.sqrt(sum(float((a.detach() - b).pow(2).sum()) for a, b in zip(clipped.parameters(), before)))
    assert moved == pytest.approx(0.1 * 0.01, rel=1e-4)  # lr x max_norm


def test_fp16_overflow_skips_the_update_and_counts_it():
    def exploding(model, batch):
        return mse_step(model, batch) * 1e6  # x 65536 (the scaler's first scale) overflows fp16 gradients

    model, batch = model_and_batch()
    before = [p.detach().clone() for p in model.parameters()]
    trained, metrics, step = run_steps(TrainerSpec(precision="fp16-mixed"), steps=2, user_step=exploding)
    assert [float(m[2]) for m in metrics] == [1.0, 2.0]  # skipped so far
    assert all(torch.equal(a, b) for a, b in zip(trained.parameters(), before))
    assert step.scaler.get_scale() == 65536.0 / 4  # halved at each skip


def test_bf16_autocast_runs_the_forward_in_bf16_and_keeps_fp32_weights():
    seen = {}

    def spy(model, batch):
        out = model[0](batch[0])
        seen["dtype"] = out.dtype
        return out.float().pow(2).mean()

    model, _, _ = run_steps(TrainerSpec(precision="bf16-mixed"), steps=1, user_step=spy)
    assert seen["dtype"] == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("mode, marks", [("default", 0), ("max-autotune-no-cudagraphs", 0), ("reduce-overhead", 1),
                                         ("max-autotune", 1)])
def test_a_step_under_cuda_graphs_marks_where_the_last_steps_outputs_die(mode, marks):
    """CUDA graphs (compile modes reduce-overhead, max-autotune): each step tells torch that a new iteration
    begins; torch counts the marks down from 0 (the count it then uses instead of its own guess)."""
    from torch._inductor.cudagraph_trees import MarkStepBox

    model, _ = model_and_batch()
    trainer = TrainerSpec.model_validate({"compile": {"enabled": True, "mode": mode}})
    step = ReplicaStep(mse_step, model, torch.optim.SGD(model.parameters(), lr=0.1), trainer, "cpu", manual=False)
    before = MarkStepBox.mark_step_counter
    try:
        step.begin()
        step.begin()
        assert MarkStepBox.mark_step_counter == before - 2 * marks
        accumulating = ReplicaStep(mse_step, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   trainer.model_copy(update={"grad_accum_steps": 3}), "cpu", manual=False)
        accumulating(model_and_batch()[1])  # the loop marks the first micro-batch; the step, the two after it
        assert MarkStepBox.mark_step_counter == before - 4 * marks
    finally:
        MarkStepBox.mark_step_counter = before  # torch's own count, as the other tests found it


@pytest.mark.parametrize("returned, said", [
    (None, "None (did it forget `return loss`?)"),
    (torch.ones(3), "a tensor of shape (3,);"),
    (1.5, "a float (.item() or float() makes a number, which dlaunch cannot backpropagate: return the tensor);"),
    # a "loss" that is there but not a scalar tensor: what it is, not as if it were missing
    ({"loss": 1.5, "acc": 0.5}, 'a dict whose "loss" is a float (.item() or float() makes a number'),
    ({"loss": torch.ones(32)}, 'a dict whose "loss" is a tensor of shape (32,);'),
    ({}, "a dict with nothing in it;"),
])
def test_a_step_that_returns_no_scalar_loss_names_the_function(returned, said):
    with pytest.raises(StepError, match=r"train_step\(\) \(.*test_step.py:\d+\) returned " + re.escape(said)):
        run_steps(TrainerSpec(), steps=1, user_step=lambda model, batch: returned)


@pytest.mark.parametrize("accum", [1, 2])
def test_a_step_that_returns_a_detached_loss_names_the_function(accum):
    """torch alone says "element 0 of tensors does not require grad" from inside autograd, with no user frame."""
    with pytest.raises(StepError, match=r"train_step\(\) \(.*test_step.py:\d+\) returned a loss that does not require grad"):
        run_steps(TrainerSpec(grad_accum_steps=accum), steps=1, user_step=lambda model, batch: mse_step(model, batch).detach())


def test_split_batch_cuts_nested_batches_along_the_first_dimension():
    batch = {"x": torch.arange(8).view(4, 2), "pair": (torch.arange(4), [torch.arange(4)])}
    parts = split_batch(batch, 2)
    assert [p["x"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert parts[1]["pair"][0].tolist() == [2, 3] and parts[1]["pair"][1][0].tolist() == [2, 3]
    assert [p.tolist() for p in split_batch(torch.arange(4), 3)] == [[0, 1], [2], [3]]  # a last partial batch
    assert [p.tolist() for p in split_batch(torch.arange(2), 4)] == [[0], [1]]  # fewer rows than micro-batches
    with pytest.raises(TypeError, match="cuts a batch's tensors along their first dimension"):
        split_batch({"name": "no tensors"}, 2)


def test_micro_batches_keep_a_namedtuple_and_give_other_columns_to_each():
    """As the split across replicas does: accumulation must not break a batch that trains without it."""
    import collections

    Example = collections.namedtuple("Example", "x y ids")
    parts = split_batch(Example(torch.arange(4), torch.arange(4) * 10, "batch-7"), 2)
    assert [type(p) for p in parts] == [Example, Example]
    assert [p.x.tolist() for p in parts] == [[0, 1], [2, 3]] and [p.ids for p in parts] == ["batch-7", "batch-7"]


@pytest.mark.parametrize("rows", [9, 3])
def test_a_batch_that_does_not_divide_into_micro_batches_gives_the_whole_batch_update(rows):
    """drop_remainder=false: an epoch's last batch of 9 rows over 4 micro-batches (3, 2, 2, 2) or of 3 rows (1, 1, 1)."""
    full, full_metrics, _ = run_steps(TrainerSpec(), rows=rows)
    accumulated, acc_metrics, _ = run_steps(TrainerSpec(grad_accum_steps=4), rows=rows)
    for a, b in zip(full.parameters(), accumulated.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(full_metrics[-1][0], acc_metrics[-1][0], rtol=1e-6, atol=0)  # the batch's mean loss


def test_fp16_says_when_it_skipped_every_step_of_the_run(caplog):
    """A NaN loss makes GradScaler skip every update: the run completes with the model unchanged, and says so."""
    from launcher.runtime.step import warn_if_all_skipped

    with caplog.at_level(logging.WARNING, logger="dlaunch"):
        warn_if_all_skipped(3, 200)  # a few early skips while the scale settles: usual, nothing said
        warn_if_all_skipped(200, 200, rank=1)  # every rank counts the same skips: rank 0 says it
        warn_if_all_skipped(200, 200)
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("fp16-mixed skipped all 200 steps of the run (inf/NaN gradients): the model did not train")


def step_with_metrics(model, batch):
    x, y = batch
    out = model(x)
    return {"loss": torch.nn.functional.mse_loss(out, y), "abs_error": (out - y).abs().mean(), "rows": x.shape[0]}


def test_a_step_that_returns_metrics_of_its_own_trains_as_one_that_returns_the_loss():
    """[loss, grad_norm, skipped, abs_error, rows]: the recipe's metrics after dlaunch's, in their names' order; with
    accumulation, averaged over the micro-batches as the loss is (4 rows each: the mean is 4, the error the batch's)."""
    plain, plain_metrics, _ = run_steps(TrainerSpec())
    full, metrics, step = run_steps(TrainerSpec(), user_step=step_with_metrics)
    accumulated, acc_metrics, acc_step = run_steps(TrainerSpec(grad_accum_steps=4), user_step=step_with_metrics)
    assert step.metric_names == acc_step.metric_names == ("abs_error", "rows")
    for a, b in zip(plain.parameters(), full.parameters()):
        assert torch.equal(a, b)
    model, batch = model_and_batch()
    x, y = batch
    assert metrics[0].tolist()[:3] == plain_metrics[0].tolist()
    torch.testing.assert_close(metrics[0][3], (model(x) - y).abs().mean().detach())  # before the first update
    assert metrics[0][4] == 16 and acc_metrics[0][4] == 4
    torch.testing.assert_close(acc_metrics[0][3], metrics[0][3], rtol=1e-6, atol=0)
    assert step(batch, measure=False).dim() == 0  # a step that is not logged: the loss alone, no metrics built


@pytest.mark.parametrize("returned, says", [
    ({"lr": 0.1}, "named ['lr']; dlaunch's records use"),
    ({"acc": 0.5, 1: 0.5}, "named [1]; dlaunch's records use"),
    ({"lr_group1": 0.1}, "named ['lr_group1']; dlaunch's records use"),  # another parameter group's rate
    ({"acc": torch.ones(3)}, "metrics ['acc'] that are not numbers"),
    ({"acc": "high"}, "metrics ['acc'] that are not numbers"),
])
def test_metrics_a_step_cannot_log_are_named(returned, says):
    def user_step(model, batch):
        return {"loss": mse_step(model, batch), **returned}

    with pytest.raises(StepError, match=re.escape(says)):
        run_steps(TrainerSpec(), steps=1, user_step=user_step)


def test_a_dict_without_the_loss_and_metrics_that_change_are_named():
    with pytest.raises(StepError, match="a dict of 'los', 'acc', without \"loss\""):  # its keys named
        run_steps(TrainerSpec(), steps=1, user_step=lambda model, batch: {"los": mse_step(model, batch), "acc": 1.0})
    calls = []

    def changing(model, batch):
        calls.append(1)
        return {"loss": mse_step(model, batch), **({"a": 1.0} if len(calls) == 1 else {"b": 1.0})}

    with pytest.raises(StepError, match=re.escape("returned the metrics ['b'], and ['a'] at the first logged step")):
        run_steps(TrainerSpec(), steps=2, user_step=changing)


def reshaping_step(model, batch):
    """Model code that cannot take a batch of 0 rows (a reshape with -1)."""
    x, y = batch
    return torch.nn.functional.mse_loss(model(x.reshape(x.shape[0], -1)), y)


def train_on(strategy, batches, trainer=None, pad=True, resumed=False):
    """The loop's way: the distributed stream's batches, their global rows and pads through ReplicaStep; the
    parameters and the logged losses. ``resumed``: each step as if it were the first after a resume."""
    from launcher.input.position import DataStream

    model, _ = model_and_batch()
    with strategy.scope():
        model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = ReplicaStep(reshaping_step, model, optimizer, trainer or TrainerSpec(), "cpu", manual=False)
    stream, losses = DataStream(strategy.experimental_distribute_dataset(batches)), []
    for _ in batches:
        batch = next(stream)
        if resumed:
            step.stand_ins.clear()
        args = (batch, True, stream.rows, stream.pad) if pad else (batch, True, stream.rows)
        losses.append(strategy.reduce("MEAN", strategy.run(step, args=args), axis=None)[0].item())
    return [p.detach().clone() for p in model.parameters()], losses


def assert_trains_as_on_one_device(strategy, batches, trainer=None, resumed=False):
    from launcher import distribute as dl

    one, one_losses = train_on(dl.OneDeviceStrategy("cpu"), batches, trainer)
    two, two_losses = train_on(strategy, batches, trainer, resumed=resumed)
    torch.testing.assert_close(two_losses, one_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def batches_of(*rows):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)) for n in rows]


def test_batches_that_split_unevenly_or_leave_a_replica_no_rows_train_as_on_one_device(strategy):
    assert_trains_as_on_one_device(strategy, batches_of(51, 51, 1, 51))  # 26 + 25 rows; the 1-row batch leaves replica 1 none


@pytest.mark.parametrize("rows", [(51, 3, 51), (51, 1, 51), (51, 35, 51)])
def test_accumulation_over_a_share_of_fewer_rows_than_micro_batches_trains_as_on_one_device(strategy, rows):
    """A partial batch of 3 rows over 2 replicas (2 and 1) or of 1 (1 and none), 4 micro-batches: every replica runs
    4 (each backward averages across the replica threads; FSDP2 gathers at each forward), the missing ones
    repeated at weight 0; 35 rows (26 and 9) cut unevenly."""
    assert_trains_as_on_one_device(strategy, batches_of(*rows), TrainerSpec(grad_accum_steps=4))


@pytest.mark.parametrize("accum", [1, 4])
def test_a_replica_whose_first_batch_has_no_rows_steps_on_the_pad(strategy, accum):
    """The first batch after a resume leaves replica 1 no rows and it has no earlier batch to stand in: it steps on
    the batch's pad (its first row) at weight 0, as on one device."""
    assert_trains_as_on_one_device(strategy, batches_of(51, 1, 51), TrainerSpec(grad_accum_steps=accum), resumed=True)


def test_a_replica_with_no_rows_no_earlier_batch_and_no_pad_is_told_why(strategy):
    """A step given no pad (distribute_datasets_from_function's batches are the user's)."""
    with pytest.raises(StepError, match=r"replica 1's first batch has no rows: the global batch of 1 row\(s\) is smaller "
                                        r"than the 2 replicas in sync"):
        train_on(strategy, batches_of(1), pad=False)
