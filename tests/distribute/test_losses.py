"""TF's loss convention (compute_average_loss, scale_loss) gives TF's update under strategies that average gradients."""

from __future__ import annotations

import pytest
import torch

from launcher import distribute as dl
from launcher.launch.function import run_function


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 5, generator=g), torch.randint(0, 2, (4,), generator=g)


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 2)  # the seed's Dense(2, input_shape=(5,))


def tf_update(helper: str) -> torch.Tensor:
    """One TF step on one device: the mean loss over the global batch of 4 (compute_average_loss's value)."""
    model = new_model()
    x, y = data()
    loss = torch.nn.functional.cross_entropy(model(x), y)  # sum / 4
    (loss if helper == "average" else loss + model.weight.pow(2).sum() / 1).backward()
    with torch.no_grad():
        model.weight -= 0.1 * model.weight.grad
    return model.weight.detach()


def train_one_step(strategy: dl.Strategy, helper: str) -> dict:
    model = new_model()
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data()

    def step_fn(inputs):
        features, labels = inputs
        per_example = torch.nn.functional.cross_entropy(model(features), labels, reduction="none")
        loss = dl.compute_average_loss(per_example, global_batch_size=4)
        if helper == "scale":  # a regularization term that TF divides by the replicas in sync
            weight = next(p for n, p in model.named_parameters() if n.endswith("weight"))
            loss = loss + dl.scale_loss(weight.pow(2).sum())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return dl.get_loss_reduction().name

    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    reductions = strategy.experimental_local_results(strategy.run(step_fn, args=(batch,)))
    weight = next(p for n, p in model.named_parameters() if n.endswith("weight"))
    return {"weight": weight.detach().clone(), "reductions": list(reductions)}


@pytest.mark.parametrize("helper", ["average", "scale"])
def test_a_tf_loop_on_replica_threads_gives_tfs_update(helper):
    from launcher.strategies.mirrored import MirroredStrategy

    out = train_one_step(MirroredStrategy(devices=["cpu:0", "cpu:1"]), helper)
    torch.testing.assert_close(out["weight"], tf_update(helper))
    assert out["reductions"] == ["SUM", "SUM"]


def in_processes(helper: str) -> dict:
    from launcher.strategies.mirrored import MirroredStrategy

    return train_one_step(MirroredStrategy(), helper)


@pytest.mark.slow
def test_a_tf_loop_in_processes_gives_tfs_update():
    for out in run_function(in_processes, device="cpu", nproc=2, args=("average",)).values():
        torch.testing.assert_close(out["weight"], tf_update("average"))
        assert out["reductions"] == ["SUM"]


def test_the_loss_reduction_is_mean_until_a_tf_loss_says_sum():
    import threading

    seen = []
    thread = threading.Thread(target=lambda: seen.append(dl.get_loss_reduction()))  # a fresh thread: nothing recorded
    thread.start()
    thread.join()
    assert seen == [dl.ReduceOp.MEAN]
    dl.compute_average_loss(torch.ones(3))
    assert dl.get_loss_reduction() is dl.ReduceOp.SUM


@pytest.mark.parametrize("loss_kind,gradient", [("replica_mean", 7.5), ("tf_value", 3.75), ("compute_average_loss", 7.5)])
def test_the_api_pages_worked_example(loss_kind, gradient):
    """docs/API.md: w = 1, examples x = [1, 2 | 3, 4] on 2 replica threads, loss (w x)^2 / 2, so d/dw = x^2."""
    from launcher.strategies.mirrored import MirroredStrategy

    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    linear = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(linear.weight)
    model = strategy.prepare(linear)

    def step_fn(x):
        per_example = (model(x.unsqueeze(1)).squeeze(1) ** 2) / 2
        loss = {"replica_mean": lambda: per_example.mean(), "tf_value": lambda: per_example.sum() / 4,
                "compute_average_loss": lambda: dl.compute_average_loss(per_example, global_batch_size=4)}[loss_kind]()
        loss.backward()

    strategy.run(step_fn, args=(next(iter(strategy.experimental_distribute_dataset([torch.tensor([1.0, 2.0, 3.0, 4.0])]))),))
    grads = [float(copy.grad) for copy in strategy.experimental_local_results(linear.weight)]
    assert grads == [gradient, gradient]  # each replica's copy, after the strategy's average over the 2 replicas


def test_a_replica_with_no_rows_adds_nothing_rather_than_failing():
    """A last partial batch can leave a replica no rows: its average loss is 0 (TF's div_no_nan) with a gradient of
    zeros, whether or not the global batch size is given; an explicit size of 0 is still refused."""
    weight = torch.ones(3, requires_grad=True)
    for size in (None, 32):
        loss = dl.compute_average_loss(torch.zeros(0, 3) @ weight, global_batch_size=size)
        assert loss.item() == 0.0
        loss.backward()
    assert torch.equal(weight.grad, torch.zeros(3))
    with pytest.raises(ValueError, match="must be positive"):
        dl.compute_average_loss(torch.zeros(0), global_batch_size=0)
