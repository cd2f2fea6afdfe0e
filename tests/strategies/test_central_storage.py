"""CentralStorageStrategy: parameters and optimizer state once, compute on thread replicas."""

from __future__ import annotations

import pytest
import torch

from launcher import distribute as dl
from launcher.config.compose import compose_and_validate
from launcher.config.errors import ConfigError

TWO_CPUS = ["cpu:0", "cpu:1"]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _train_central(strategy, make_optimizer, steps=5, clip=None):
    with strategy.scope():
        model = _mlp()
        model, optimizer = strategy.prepare(model, make_optimizer(model.parameters()))

    def step(batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=16)
    for _ in range(steps):
        for batch in strategy.experimental_distribute_dataset(loader):
            strategy.run(step, args=(batch,))
    return model, optimizer


def _train_one_device(make_optimizer, steps=5, clip=None):
    model = _mlp()
    optimizer = make_optimizer(model.parameters())
    x, y = _data()
    for _ in range(steps):
        for i in range(0, 64, 16):
            torch.nn.functional.mse_loss(model(x[i:i + 16]), y[i:i + 16]).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return model


def test_the_seeds_reduce_example():
    """Global batch [0..7] on two compute replicas; SUM over replicas, then over the batch axis."""
    strategy = dl.CentralStorageStrategy(compute_devices=TWO_CPUS, parameter_device="cpu:0")
    assert strategy.num_replicas_in_sync == 2
    assert strategy.extended.parameter_devices == ("cpu:0",)
    dataset = torch.utils.data.DataLoader(torch.arange(8), batch_size=8)
    for x in strategy.experimental_distribute_dataset(dataset):
        result = strategy.run(lambda val: val, args=(x,))
        assert [t.tolist() for t in strategy.experimental_local_results(result)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        result = strategy.reduce(dl.ReduceOp.SUM, result, axis=None)
        assert result.tolist() == [4, 6, 8, 10]
        assert int(strategy.reduce(dl.ReduceOp.SUM, result, axis=0)) == 28


def test_the_seeds_dataset_examples_on_its_default_devices():
    """``CentralStorageStrategy()``: ``range(5).batch(2)`` through ``val + 1``, and ``range(10).batch(2)`` printed as
    ``[0, 1], [2, 3], ...`` (the seed's "1 CPU and 1 GPU" computes on one device, as a CPU-only machine does)."""
    strategy = dl.CentralStorageStrategy()
    if strategy.num_replicas_in_sync != 1:
        pytest.skip("the seed's examples compute on one device; this machine has several GPUs")
    assert strategy.cluster_resolver is None  # a single-worker strategy
    batches = lambda n: strategy.experimental_distribute_dataset(torch.utils.data.DataLoader(torch.arange(n), batch_size=2))  # noqa: E731
    with strategy.scope():
        plus_one = [strategy.run(lambda val: val + 1, args=(x,)) for x in batches(5)]
    assert [[t.tolist() for t in strategy.experimental_local_results(v)] for v in plus_one] == [[[1, 2]], [[3, 4]], [[5]]]
    printed = [[t.tolist() for t in strategy.experimental_local_results(x)] for x in batches(10)]
    assert printed == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]], [[8, 9]]]


def test_dataset_fn_is_called_once_for_its_one_worker():
    """"we only have one worker so dataset_fn is called once": two compute replicas dequeue from its one dataset."""
    strategy = dl.CentralStorageStrategy(compute_devices=TWO_CPUS, parameter_device="cpu:0")
    contexts = []

    def dataset_fn(input_context):
        contexts.append((input_context.num_input_pipelines, input_context.input_pipeline_id, input_context.num_replicas_in_sync))
        return [torch.full((input_context.get_per_replica_batch_size(4), 1), float(i)) for i in range(4)]

    steps = [[t.flatten().tolist() for t in strategy.experimental_local_results(b)]
             for b in strategy.experimental_distribute_datasets_from_function(dataset_fn)]
    assert contexts == [(1, 0, 2)]
    assert steps == [[[0.0, 0.0], [1.0, 1.0]], [[2.0, 2.0], [3.0, 3.0]]]


@pytest.mark.parametrize("clip", [None, 0.5])
def test_an_mlp_with_sgd_momentum_trains_as_on_one_device(clip):
    def sgd(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    model, _ = _train_central(dl.CentralStorageStrategy(compute_devices=TWO_CPUS), sgd, clip=clip)
    reference = _train_one_device(sgd, clip=clip)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(model.module.get_parameter(name), p, rtol=1e-5, atol=1e-6)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_parameters_and_optimizer_state_exist_once():
    """Adam's state is 2x the parameters, on the parameter device, and no replica holds a copy of either."""
    model, optimizer = _train_central(dl.CentralStorageStrategy(compute_devices=TWO_CPUS), torch.optim.Adam, steps=1)
    params = list(model.module.parameters())
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert _bytes(moments) == 2 * _bytes(params) == 2 * 4 * (8 * 16 + 16 + 16 + 1)
    assert all(t.device.type == "cpu" for t in params + moments)
    assert len(optimizer.state) == len(params) and optimizer.primary is optimizer._primary
    # Replicas read the central storage itself: their leaves hold no memory of their own.
    central = {p.untyped_storage().data_ptr() for p in params}
    for replica in model.replicas:
        assert {q.untyped_storage().data_ptr() for q in replica.parameters()} == central
    # One optimizer, one state: no optimizer per replica.
    assert not hasattr(optimizer, "optimizers")
    state_per_replica = [sum(_bytes([q.grad]) for q in r.parameters() if q.grad is not None) for r in model.replicas]
    assert state_per_replica == [0, 0]  # gradients were zeroed; nothing else lives on the replicas


def test_every_replica_steps_but_the_update_is_applied_once():
    strategy = dl.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.constant_(model.weight, 1.0)
        model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))

    def step(x):
        model(x).sum().backward()  # d/dw = x
        optimizer.step()
        optimizer.zero_grad()

    values = dl.PerReplica([torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.tensor([[3.0]])])
    strategy.run(step, args=(values,))
    assert model.module.weight.item() == pytest.approx(1.0 - 2.0)  # one step with the mean gradient 2


def test_checkpoints_see_the_central_module_and_optimizer():
    from launcher.checkpoint.state import model_and_optimizer

    model, optimizer = _train_central(dl.CentralStorageStrategy(compute_devices=TWO_CPUS), torch.optim.Adam, steps=1)
    state = model_and_optimizer(model, optimizer)
    assert set(state["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert set(state["optim"]["state"]) == set(state["model"])


def test_an_optimizer_over_another_models_parameters_is_refused():
    """The central optimizer steps the model's own parameters: one built over other tensors would train nothing."""
    strategy = dl.CentralStorageStrategy(compute_devices=TWO_CPUS)
    with strategy.scope():
        model = _mlp()
        stray = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.zeros(3))], lr=0.1)
        with pytest.raises(ValueError, match=r"holds 1 parameter\(s\) that are not the model's"):
            strategy.prepare(model, stray)
        elsewhere = torch.optim.SGD(_mlp().parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"holds 4 parameter\(s\) that are not the model's"):
            strategy.prepare(model, elsewhere)


def test_a_failed_step_leaves_no_gradient_pending():
    strategy = dl.CentralStorageStrategy(compute_devices=TWO_CPUS)
    with strategy.scope():
        model = strategy.prepare(torch.nn.Linear(2, 1))

    def failing(x):
        model(x).sum().backward()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        strategy.run(failing, args=(dl.PerReplica([torch.ones(1, 2), torch.ones(1, 2)]),))
    assert all(q.grad is None for r in model.replicas for q in r.parameters())


def test_config_counts_replicas_and_needs_one_process():
    spec = compose_and_validate(["strategy=central_storage", "strategy.compute_devices=[cpu:0,CPU:1]"], cuda_devices=0)
    assert spec.num_replicas == 2 and spec.num_processes == 1
    assert spec.strategy.compute_devices == ["cpu:0", "cpu:1"]
    with pytest.raises(ConfigError) as exc:
        compose_and_validate(["strategy=central_storage", "cluster=2x4"], cuda_devices=0)
    assert "cluster 2x4 = 2 node(s) x 4 device(s) = 8 processes; list the devices" in str(exc.value.problems)
    assert "cluster=1x1 'strategy.compute_devices=[cpu:0,cpu:1,cpu:2,cpu:3]'" in str(exc.value.problems)  # one machine's
    with pytest.raises(ConfigError) as exc:  # the command to type instead, with the devices auto picks
        compose_and_validate(["strategy=central_storage", "cluster=1x2"], cuda_devices=2)
    assert "cluster=1x1 'strategy.compute_devices=[cuda:0,cuda:1]'" in str(exc.value.problems)


def test_config_rejects_a_missing_gpu():
    with pytest.raises(ConfigError, match="cuda:1 was asked for, but this machine has 1 CUDA device"):
        compose_and_validate(["strategy=central_storage", "strategy.compute_devices=[cuda:0,cuda:1]"], cuda_devices=1)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@needs_cuda
def test_seed_example_with_parameters_on_cpu_and_compute_on_cpu_and_gpu():
    strategy = dl.CentralStorageStrategy(compute_devices=["CPU:0", "GPU:0"], parameter_device="CPU:0")
    model, _ = _train_central(strategy, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    assert all(p.device.type == "cpu" for p in model.module.parameters())
    reference = _train_one_device(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    for name, p in reference.named_parameters():
        torch.testing.assert_close(model.module.get_parameter(name), p, rtol=1e-4, atol=1e-5)


@needs_two_gpus
@pytest.mark.parametrize("parameter_device", ["cpu:0", "cuda:0"])
def test_two_gpus_with_parameters_on_cpu_or_one_gpu(parameter_device):
    strategy = dl.CentralStorageStrategy(compute_devices=["cuda:0", "cuda:1"], parameter_device=parameter_device)
    model, optimizer = _train_central(strategy, torch.optim.Adam)
    assert {p.device for p in model.module.parameters()} == {torch.device(parameter_device if parameter_device != "cpu:0" else "cpu")}
    assert {s["exp_avg"].device for s in optimizer.state.values()} == {p.device for p in model.module.parameters()}
    reference = _train_one_device(torch.optim.Adam)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(model.module.get_parameter(name).cpu(), p, rtol=1e-4, atol=1e-5)


def test_the_plan_says_cpu_replica_threads_share_one_random_generator(run_dlaunch):
    """Their dropout masks come from the CPU's one generator in the order the threads run: a numerics audit found
    identical commands diverging at step 2, which OPERATIONS.md's "exact" had promised; the plan says so now."""
    two = ("strategy=central_storage", "strategy.compute_devices=[cpu:0,cpu:1]", "launch.dry_run=true")
    proc, _ = run_dlaunch(*two)
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "random its 2 CPU replica threads share the CPU's random generator: a step that draws random numbers " \
           "(dropout) differs from run to run" in out
    proc, _ = run_dlaunch("strategy=central_storage", "launch.dry_run=true", name="one")
    assert proc.returncode == 0 and "random generator" not in proc.stdout
