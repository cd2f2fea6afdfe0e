"""Mirrored copies of a model in one process (MirroredModule / MirroredOptimizer), trained on threads."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from launcher import distribute as dl
from launcher.distribute import ReduceOp
from launcher.distribute.replicated import MirroredModule, MirroredOptimizer

SEED = 1234
STEPS = 5
GLOBAL_BATCH = 8


def _build(batchnorm=False):
    torch.manual_seed(SEED)
    layers = [nn.Linear(4, 8)] + ([nn.BatchNorm1d(8)] if batchnorm else []) + [nn.ReLU(), nn.Linear(8, 1)]
    return nn.Sequential(*layers)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _global_batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)) for _ in range(STEPS)]


def _mirrored(strategy, batchnorm=False):
    with strategy.scope():
        model = _build(batchnorm)
        model, opt = strategy.prepare(model, _sgd(model))
    return model, opt


def _train_step(model, opt):
    def step(batch):
        x, y = batch
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def _assert_replicas_bitwise_equal(model):
    first, second = model.replicas
    assert first is not second
    for (name, a), b in zip(first.named_parameters(), second.parameters()):
        assert a.data_ptr() != b.data_ptr(), name
        assert torch.equal(a, b), name
    for (name, a), b in zip(first.named_buffers(), second.buffers()):
        assert torch.equal(a, b), name


def test_prepare_makes_one_copy_per_replica(strategy):
    model, opt = _mirrored(strategy)
    assert isinstance(model, MirroredModule) and isinstance(opt, MirroredOptimizer)
    assert len(model.replicas) == 2 and model.replicas[0] is model.module
    assert [p for p in model.parameters()] == [p for p in model.replicas[0].parameters()]
    assert len(opt.optimizers) == 2 and opt.optimizers[0].param_groups is opt.param_groups


def test_prepare_without_optimizer_returns_the_module_alone(strategy):
    with strategy.scope():
        model = strategy.prepare(_build())
    assert isinstance(model, MirroredModule)


def test_replicas_are_bitwise_equal_at_start_and_after_every_step(strategy):
    model, opt = _mirrored(strategy)
    _assert_replicas_bitwise_equal(model)
    step = _train_step(model, opt)
    for batch in strategy.experimental_distribute_dataset(_global_batches()):
        strategy.run(step, args=(batch,))
        _assert_replicas_bitwise_equal(model)
        for a, b in zip(opt.optimizers[0].state.values(), opt.optimizers[1].state.values()):
            assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


def test_training_matches_a_single_model_on_the_global_batch(strategy):
    model, opt = _mirrored(strategy)
    step = _train_step(model, opt)
    mirrored_losses = []
    for batch in strategy.experimental_distribute_dataset(_global_batches()):
        mirrored_losses.append(strategy.reduce(ReduceOp.MEAN, strategy.run(step, args=(batch,)), axis=None))

    reference = _build()
    ref_opt = _sgd(reference)
    ref_losses = [_train_step(reference, ref_opt)(batch) for batch in _global_batches()]

    for got, want in zip(model.replicas[0].parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(model.replicas[1].parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(reference.parameters(), _build().parameters()))  # it trained
    torch.testing.assert_close(torch.stack(mirrored_losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)


def test_each_replica_sees_only_its_half_of_the_global_batch(strategy):
    model, opt = _mirrored(strategy)
    (batch,) = strategy.experimental_distribute_dataset(_global_batches()[:1])
    sizes = strategy.run(lambda b: b[0].shape[0], args=(batch,))
    assert sizes.values == (GLOBAL_BATCH // 2, GLOBAL_BATCH // 2)


def test_batchnorm_buffers_are_equal_across_replicas_after_step(strategy):
    model, opt = _mirrored(strategy, batchnorm=True)
    bn0, bn1 = model.replicas[0][1], model.replicas[1][1]
    step = _train_step(model, opt)
    for batch in strategy.experimental_distribute_dataset(_global_batches()[:2]):
        strategy.run(step, args=(batch,))
        _assert_replicas_bitwise_equal(model)
    assert int(bn0.num_batches_tracked) == int(bn1.num_batches_tracked) == 2
    assert not torch.equal(bn0.running_mean, torch.zeros(8))  # the statistics did move


def test_lr_scheduler_on_returned_optimizer_changes_lr_of_every_replica(strategy):
    model, opt = _mirrored(strategy)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = _train_step(model, opt)

    reference = _build()
    ref_opt = _sgd(reference)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    ref_step = _train_step(reference, ref_opt)

    batches = _global_batches()[:3]
    for batch, global_batch in zip(strategy.experimental_distribute_dataset(batches), batches):
        strategy.run(step, args=(batch,))
        ref_step(global_batch)
        _assert_replicas_bitwise_equal(model)
        scheduler.step()
        ref_scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    strategy.run(step, args=(next(iter(strategy.experimental_distribute_dataset(batches[:1]))),))
    assert [o.param_groups[0]["lr"] for o in opt.optimizers] == [pytest.approx(0.0125)] * 2
    ref_step(batches[0])
    for got, want in zip(model.replicas[1].parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_optimizer_step_outside_run_raises_runtime_error(strategy):
    model, opt = _mirrored(strategy)
    with pytest.raises(RuntimeError, match="inside strategy.run"):
        opt.step()


def test_zero_grad_outside_run_clears_every_replica(strategy):
    model, opt = _mirrored(strategy)
    for replica in model.replicas:
        replica(torch.ones(2, 4)).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for replica in model.replicas for p in replica.parameters())


def test_forward_outside_run_uses_the_primary_copy(strategy):
    model, _ = _mirrored(strategy)
    x = torch.ones(3, 4)
    assert torch.equal(model(x), model.replicas[0](x))


def test_train_and_eval_switch_every_copy(strategy):
    model, _ = _mirrored(strategy, batchnorm=True)
    model.eval()
    assert not any(r.training for r in model.replicas)
    model.train()
    assert all(r.training for r in model.replicas)


def test_state_dict_is_the_primary_optimizers(strategy):
    model, opt = _mirrored(strategy)
    strategy.run(_train_step(model, opt), args=(next(iter(strategy.experimental_distribute_dataset(_global_batches()[:1]))),))
    assert opt.state_dict()["state"].keys() == opt.optimizers[0].state_dict()["state"].keys()
    torch.testing.assert_close(opt.state_dict()["state"][0]["momentum_buffer"], opt.optimizers[1].state_dict()["state"][0]["momentum_buffer"])


def test_optimizer_over_foreign_parameters_is_rejected(strategy):
    model = _build()
    foreign = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not the model's"):
        strategy.prepare(model, foreign)


def test_prepare_accepts_adamw(strategy):
    with strategy.scope():
        model = _build()
        model, opt = strategy.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert isinstance(opt.optimizers[1], torch.optim.AdamW)


def test_gradient_clipping_sees_averaged_gradients_like_ddp(strategy):
    """clip_grad_norm_(model.parameters()) inside run gives what one model on the whole batch gives."""
    torch.manual_seed(0)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    reference = torch.nn.Linear(4, 1)
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
        model.load_state_dict(reference.state_dict())
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)

    def step(x, y):
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
        opt.step()
        opt.zero_grad()

    for x, y in data:
        strategy.run(step, args=(dl.PerReplica([x[:4], x[4:]]), dl.PerReplica([y[:4], y[4:]])))
        torch.nn.functional.mse_loss(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(model.replicas[0].parameters(), model.replicas[1].parameters()):
        assert torch.equal(a, b)
    for a, b in zip(model.module.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert list(model.parameters()) == list(model.module.parameters())  # outside run: the primary


def test_nested_run_raises_instead_of_hanging(strategy):
    with pytest.raises(RuntimeError, match="inside strategy.run"):
        strategy.run(lambda: strategy.run(lambda: 1))
    assert strategy.run(lambda: 2).values == (2, 2)


def _prepare_ddp_wrapped():
    """A torchrun script's model, DDP(model) kept, given to prepare() in a real two-process mirrored run."""
    strategy = dl.MirroredStrategy()
    with strategy.scope():
        model = _build()
    said = []
    for wrapped in (torch.nn.parallel.DistributedDataParallel(model), torch.compile(torch.nn.parallel.DistributedDataParallel(model))):
        try:
            strategy.prepare(wrapped, _sgd(model))
            said.append(None)
        except TypeError as exc:
            said.append(str(exc))
    return said


@pytest.mark.slow
def test_a_model_ddp_wraps_already_is_refused_by_prepare_not_wrapped_twice():
    """Wrapped again, each backward all-reduced twice without a word (the half-way move from torchrun)."""
    from launcher.launch.function import run_function

    for said in run_function(_prepare_ddp_wrapped, device="cpu", nproc=2).values():
        assert len(said) == 2 and all(m and "wrapped in DistributedDataParallel: pass the model itself" in m for m in said)


def test_a_model_dataparallel_wraps_is_refused_by_prepare(strategy):
    with strategy.scope():
        wrapped = nn.DataParallel(_build())
    with pytest.raises(TypeError, match="wrapped in DataParallel: pass the model itself"):
        strategy.prepare(wrapped, _sgd(wrapped))


def test_dataparallel_under_one_replica_is_the_users_own_choice_and_prepared_as_is():
    strategy = dl.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        wrapped = nn.DataParallel(_build())
    model, _ = strategy.prepare(wrapped, _sgd(wrapped))  # nothing of prepare's would wrap it again
    assert isinstance(model, nn.DataParallel)


@pytest.mark.parametrize("kind", ["mirrored", "central_storage"])
def test_a_model_stepped_on_every_replica_thread_without_prepare_is_refused_not_raced(kind):
    """Built in scope() as in TF, but never given to prepare: each replica thread stepped the one shared model while
    another read it in its forward, and two runs of the same code printed different, wrong losses, with no error."""
    strategy = (dl.MirroredStrategy(devices=["cpu:0", "cpu:1"]) if kind == "mirrored"
                else dl.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"]))
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        model(x).pow(2).mean().backward()
        optimizer.step()

    with pytest.raises(RuntimeError, match="optimizer.step\\(\\) of one SGD ran on two of the 2 replica threads"):
        strategy.run(step, args=(strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(2, 4)),))
    with strategy.scope():
        model, optimizer = strategy.prepare(model, optimizer)  # prepared: one copy per replica, or one update for all
    for _ in range(2):
        strategy.run(step, args=(strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(2, 4)),))
