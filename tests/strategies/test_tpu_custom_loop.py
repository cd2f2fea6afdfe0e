"""tpu_strategy.txt's custom training loop, line for line: TF's update on replica threads and on TPUStrategy processes.

The seed's step takes ``tape.gradient`` of each replica's per-example loss (the gradient
of its sum) and TF sums the replicas' gradients. dlaunch averages them, so the loss goes
through ``dl.compute_average_loss``: with ``global_batch_size=1`` it is the seed's
unscaled loss, with ``2`` (the global batch) TF's recommended mean; either way the update
is TF's. A plain ``loss.sum().backward()`` gets the average: half the seed's step.
"""

from __future__ import annotations

import pytest
import torch

from launcher import distribute as dl
from launcher.launch.function import run_function

FEATURES = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5], [0.9, 0.7, 0.5, 0.3, 0.1]])  # the seed's np.random.random((2, 5))
LABELS = torch.tensor([[1], [0]])  # np.random.randint(2, size=(2, 1))
CASES = {"seed": 1, "global_batch": 2, "plain": None}  # loss scaling -> compute_average_loss's global_batch_size


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 2)  # tf.keras.layers.Dense(2, input_shape=(5,))


def tf_update(case: str) -> torch.Tensor:
    """TF's step: each replica's gradient of its row's loss (sum over its batch of 1), summed over replicas."""
    model = new_model()
    losses = torch.nn.functional.cross_entropy(model(FEATURES), LABELS.squeeze(1), reduction="none")
    scale = {"seed": 1.0, "global_batch": 0.5, "plain": 0.5}[case]  # plain: dlaunch's mean of the 2 replicas
    (losses.sum() * scale).backward()
    return (model.weight - 0.1 * model.weight.grad).detach()


def custom_loop(strategy: dl.Strategy, case: str) -> dict:
    with strategy.scope():
        model = new_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # tf.keras.optimizers.SGD(learning_rate=0.1)
    model, optimizer = strategy.prepare(model, optimizer)

    def dataset_fn(ctx):
        rows = list(zip(FEATURES, LABELS))[ctx.input_pipeline_id :: ctx.num_input_pipelines]  # one row per replica
        return [(f.unsqueeze(0), y.unsqueeze(0)) for f, y in rows] * 3  # .repeat().batch(1, drop_remainder=True)

    dist_dataset = strategy.experimental_distribute_datasets_from_function(dataset_fn)
    iterator = iter(dist_dataset)

    def train_step(iterator):
        def step_fn(inputs):
            features, labels = inputs
            logits = model(features)
            loss = torch.nn.functional.cross_entropy(logits, labels.squeeze(1), reduction="none")  # per example
            if CASES[case] is None:
                loss.sum().backward()  # the tape's gradient of a vector, averaged by the strategy
            else:
                dl.compute_average_loss(loss, global_batch_size=CASES[case]).backward()
            optimizer.step()
            return dl.get_loss_reduction().name

        return strategy.run(step_fn, args=(next(iterator),))

    reductions = strategy.experimental_local_results(train_step(iterator))
    weight = next(p for n, p in model.named_parameters() if n.endswith("weight"))
    return {"weight": weight.detach().clone(), "reductions": list(reductions)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_custom_loop_on_replica_threads_gives_tfs_update(case):
    from launcher.strategies.mirrored import MirroredStrategy

    out = custom_loop(MirroredStrategy(devices=["cpu:0", "cpu:1"]), case)
    torch.testing.assert_close(out["weight"], tf_update(case))
    if case != "plain":
        assert out["reductions"] == ["SUM", "SUM"]  # get_loss_reduction: the last loss reduction


def in_a_process(case: str) -> dict:
    return custom_loop(dl.TPUStrategy(), case)  # 2 processes: 2 replicas of one logical device


@pytest.mark.slow
@pytest.mark.parametrize("case", ["seed", "plain"])
def test_the_custom_loop_on_tpu_strategy_processes_gives_tfs_update(case):
    for out in run_function(in_a_process, device="cpu", nproc=2, args=(case,)).values():
        torch.testing.assert_close(out["weight"], tf_update(case))
        assert out["reductions"] == (["SUM"] if case == "seed" else ["MEAN"])  # a fresh process: MEAN until a helper
