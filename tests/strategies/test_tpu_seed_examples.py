"""tpu_strategy.txt's examples on replica threads and on TPUStrategy processes (the model-parallel ones: test_mesh*.py).

The custom training loop: the seed's step takes ``tape.gradient`` of each replica's per-example loss (the gradient
of its sum) and TF sums the replicas' gradients. dlaunch averages them, so the loss goes
through ``dl.compute_average_loss``: with ``global_batch_size=1`` it is the seed's
unscaled loss, with ``2`` (the global batch) TF's recommended mean; either way the update
is TF's. A plain ``loss.sum().backward()`` gets the average: half the seed's step.
"""

from __future__ import annotations

import pytest
import torch

from launcher import distribute as dl
from launcher.distribute.devices import to_torch
from launcher.launch.function import run_function

FEATURES = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5], [0.9, 0.7, 0.5, 0.3, 0.1]])  # the seed's np.random.random((2, 5))
LABELS = torch.tensor([[1], [0]])  # np.random.randint(2, size=(2, 1))
CASES = {"seed": 1, "global_batch": 2, "plain": None}  # loss scaling -> compute_average_loss's global_batch_size


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 2)  # tf.keras.layers.Dense(2, input_shape=(5,))


def seed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The seed's ``tf.keras.losses.sparse_categorical_crossentropy(labels, logits)``, per example. Its default
    ``from_logits=False`` takes the Dense outputs as probabilities: tf.keras 2 clips them to ``[1e-7, 1 - 1e-7]``
    (no gradient where clipped) and puts their log through softmax cross-entropy."""
    return torch.nn.functional.cross_entropy(logits.clamp(1e-7, 1 - 1e-7).log(), labels.squeeze(1), reduction="none")


def tf_update(case: str) -> torch.Tensor:
    """TF's step: each replica's gradient of its row's loss (sum over its batch of 1), summed over replicas."""
    model = new_model()
    losses = seed_loss(model(FEATURES), LABELS)
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
            loss = seed_loss(logits, labels)  # per example
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


def page_examples(strategy: dl.Strategy) -> dict:
    """The page's value, dataset and reduce examples; each entry lists this process's replicas' results."""
    import warnings

    import numpy as np

    local = lambda fn: [v.tolist() if hasattr(v, "tolist") else v for v in  # noqa: E731
                        strategy.experimental_local_results(strategy.experimental_distribute_values_from_function(fn))]
    array_value = np.array([3.0, 2.0, 1.0])
    multiple_values = [torch.tensor(1.0, device=to_torch(d)) for d in strategy.extended.worker_devices]  # this worker's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        numpy_rows = strategy.experimental_make_numpy_dataset(np.ones([10], dtype=np.float32))
    numpy_batch = next(iter(strategy.experimental_distribute_dataset(torch.utils.data.DataLoader(numpy_rows, batch_size=2))))

    def dataset_fn(input_context):  # d = tf.data.Dataset.from_tensors([[1.]]).repeat().batch(batch_size), global batch 8
        batch_size = input_context.get_per_replica_batch_size(8)
        return [torch.ones(batch_size, 1)] * 2

    ds = strategy.experimental_distribute_datasets_from_function(dataset_fn)
    v = strategy.run(lambda t: t, args=(next(iter(strategy.experimental_distribute_dataset([torch.arange(8)]))),))
    partial = strategy.run(lambda t: t.float(), args=(next(iter(strategy.experimental_distribute_dataset([torch.arange(6)]))),))
    return {
        "constant": local(lambda ctx: torch.tensor(1.0)),
        "array": local(lambda ctx: array_value[ctx.replica_id_in_sync_group]),
        "num_replicas": local(lambda ctx: ctx.num_replicas_in_sync),
        "on_device": local(lambda ctx: multiple_values[ctx.replica_id_in_sync_group % len(multiple_values)]),
        "numpy": [t.tolist() for t in strategy.experimental_local_results(numpy_batch)],
        "from_fn": [t.tolist() for t in strategy.experimental_local_results(next(iter(ds)))],
        "spec": str(ds.element_spec),
        "sum": strategy.reduce("SUM", v, axis=None).tolist(), "sum0": int(strategy.reduce("SUM", v, axis=0)),
        "mean_partial": float(strategy.reduce("MEAN", partial, axis=0)),
    }


def assert_page_numbers(per_replica: dict, reduced: dict) -> None:
    assert per_replica["constant"] == [1.0, 1.0] and per_replica["array"] == [3.0, 2.0]
    assert per_replica["num_replicas"] == [2, 2] and per_replica["on_device"] == [1.0, 1.0]
    assert per_replica["numpy"] == [[1.0], [1.0]]  # np.ones([10]).batch(2) split over 2 replicas
    assert per_replica["from_fn"] == [[[1.0]] * 4] * 2  # per-replica batch 8 / 2
    assert "TensorSpec(shape=(None, 1), dtype=torch.float32)" in reduced["spec"]
    assert reduced["sum"] == [4, 6, 8, 10] and reduced["sum0"] == 28 and reduced["mean_partial"] == 2.5


def test_the_pages_examples_on_replica_threads():
    from launcher.strategies.mirrored import MirroredStrategy

    out = page_examples(MirroredStrategy(devices=["cpu:0", "cpu:1"]))
    assert_page_numbers(out, out)


def page_examples_on_tpu_strategy() -> dict:
    return page_examples(dl.TPUStrategy())


@pytest.mark.slow
def test_the_pages_examples_on_tpu_strategy_processes():
    results = run_function(page_examples_on_tpu_strategy, device="cpu", nproc=2)
    per_replica = {key: results[0][key] + results[1][key] for key in ("constant", "array", "num_replicas", "on_device",
                                                                       "numpy", "from_fn")}
    for r in results.values():
        assert_page_numbers(per_replica, r)
