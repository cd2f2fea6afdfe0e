"""Strategy.reduce: the tf.distribute seed numbers (global batch 8 over 2 replicas, last partial batch of 6)."""

import numpy as np
import pytest
import torch

from launcher.distribute import PerReplica, ReduceOp


def _pass_through(strategy, batch):
    return strategy.run(lambda t: t, args=(batch,))


def _steps(strategy, batches):
    return [_pass_through(strategy, x) for x in strategy.experimental_distribute_dataset(batches)]


def test_sum_without_axis_adds_replicas_elementwise(strategy):
    (v,) = _steps(strategy, [torch.arange(8)])
    assert torch.equal(strategy.reduce(ReduceOp.SUM, v, axis=None), torch.tensor([4, 6, 8, 10]))


def test_sum_along_batch_axis_gives_global_total(strategy):
    (v,) = _steps(strategy, [torch.arange(8)])
    assert torch.equal(strategy.reduce(ReduceOp.SUM, v, axis=0), torch.tensor(28))


def test_reducing_the_cross_replica_sum_again_along_axis_gives_28(strategy):
    (v,) = _steps(strategy, [torch.arange(8)])
    summed = strategy.reduce(ReduceOp.SUM, v, axis=None)
    assert torch.equal(strategy.reduce(ReduceOp.SUM, summed, axis=0), torch.tensor(28))


def test_mean_without_axis_divides_by_replicas(strategy):
    (v,) = _steps(strategy, [torch.arange(8)])
    torch.testing.assert_close(strategy.reduce(ReduceOp.MEAN, v, axis=None), torch.tensor([2.0, 3.0, 4.0, 5.0]))


def test_mean_along_batch_axis_of_full_batch(strategy):
    (v,) = _steps(strategy, [torch.arange(8)])
    torch.testing.assert_close(strategy.reduce(ReduceOp.MEAN, v, axis=0), torch.tensor(3.5))


def test_last_partial_batch_mean_uses_denominator_six(strategy):
    _, last = _steps(strategy, [torch.arange(8), torch.arange(6)])
    assert torch.equal(last.values[0], torch.tensor([0, 1, 2, 3]))
    assert torch.equal(last.values[1], torch.tensor([4, 5]))
    torch.testing.assert_close(strategy.reduce(ReduceOp.MEAN, last, axis=0), torch.tensor(15 / 6))
    # not the mean of per-replica means, which would weigh examples 1/8 and 1/4: (1.5 + 4.5) / 2 == 3
    assert not torch.isclose(strategy.reduce(ReduceOp.MEAN, last, axis=0), torch.tensor(3.0))


def test_last_partial_batch_sum_along_axis(strategy):
    _, last = _steps(strategy, [torch.arange(8), torch.arange(6)])
    assert torch.equal(strategy.reduce(ReduceOp.SUM, last, axis=0), torch.tensor(15))


def test_last_partial_batch_without_axis_raises_shape_mismatch(strategy):
    _, last = _steps(strategy, [torch.arange(8), torch.arange(6)])
    with pytest.raises(ValueError, match="different shapes"):
        strategy.reduce(ReduceOp.SUM, last, axis=None)


def test_reduce_accepts_op_names(strategy):
    v = PerReplica([torch.tensor([1, 2]), torch.tensor([3, 4])])
    assert torch.equal(strategy.reduce("sum", v, axis=None), torch.tensor([4, 6]))
    torch.testing.assert_close(strategy.reduce("MEAN", v, axis=None), torch.tensor([2.0, 3.0]))
    # torch.distributed's own ops, as a ported script passes them: SUM, and AVG for MEAN
    assert torch.equal(strategy.reduce(torch.distributed.ReduceOp.SUM, v, axis=None), torch.tensor([4, 6]))
    torch.testing.assert_close(strategy.reduce(torch.distributed.ReduceOp.AVG, v, axis=None), torch.tensor([2.0, 3.0]))


def test_unknown_reduce_op_raises_value_error(strategy):
    with pytest.raises(ValueError, match="unknown reduce op"):
        strategy.reduce("max", PerReplica([torch.ones(1), torch.ones(1)]))
    with pytest.raises(ValueError, match="unknown reduce op <RedOpType.MAX"):
        strategy.reduce(torch.distributed.ReduceOp.MAX, PerReplica([torch.ones(1), torch.ones(1)]))


def test_reduce_along_inner_axis(strategy):
    v = PerReplica([torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[10, 20, 30], [40, 50, 60]])])
    assert torch.equal(strategy.reduce(ReduceOp.SUM, v, axis=1), torch.tensor([66, 165]))
    torch.testing.assert_close(strategy.reduce(ReduceOp.MEAN, v, axis=1), torch.tensor([11.0, 27.5]))


def test_reduce_keeps_the_structure_of_a_nest(strategy):
    v = {"a": PerReplica([torch.tensor(1.0), torch.tensor(3.0)]), "b": (PerReplica([torch.tensor([1]), torch.tensor([2])]),)}
    out = strategy.reduce(ReduceOp.SUM, v, axis=None)
    assert set(out) == {"a", "b"}
    assert torch.equal(out["a"], torch.tensor(4.0))
    assert torch.equal(out["b"][0], torch.tensor([3]))


def test_sum_of_a_value_that_is_not_per_replica_raises(strategy):
    with pytest.raises(ValueError, match="cannot be reduced"):
        strategy.reduce(ReduceOp.SUM, torch.tensor([1.0, 2.0]), axis=None)


def test_mean_of_a_value_that_is_not_per_replica_is_the_value(strategy):
    value = torch.tensor([1.0, 2.0])
    assert torch.equal(strategy.reduce(ReduceOp.MEAN, value, axis=None), value)


def test_mean_along_axis_of_a_plain_value_is_local(strategy):
    torch.testing.assert_close(strategy.reduce(ReduceOp.MEAN, torch.tensor([4, 6, 8, 10]), axis=0), torch.tensor(7.0))


def test_seed_example_end_to_end_over_a_dataloader(strategy):
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.arange(14)), batch_size=8, shuffle=False, drop_last=False)
    totals = []
    for x in strategy.experimental_distribute_dataset(loader):
        v = strategy.run(lambda batch: batch[0], args=(x,))  # a TensorDataset batch is [tensor]
        totals.append(strategy.reduce(ReduceOp.SUM, v, axis=0))
    assert [int(t) for t in totals] == [28, 8 + 9 + 10 + 11 + 12 + 13]


def reduce_plain_tensors():
    """Each process's own plain tensor, reduced as Accelerate's accelerator.reduce(t) is ported."""
    import torch.distributed as dist

    from launcher import distribute as dl

    strategy = dl.MirroredStrategy()
    mine = torch.tensor([float(dist.get_rank())])
    whole = torch.tensor([4.0, 6.0, 8.0, 10.0])  # the seed's cross-replica sum, the same in every process
    return {"mean": strategy.reduce("MEAN", mine, axis=None).tolist(), "sum": strategy.reduce("SUM", mine, axis=None).tolist(),
            "nest": strategy.reduce("MEAN", {"a": mine, "n": 3}, axis=None)["a"].tolist(),
            "again": int(strategy.reduce("SUM", whole, axis=0)), "gather": strategy.gather(mine, axis=0).tolist(),
            "refused": _refusals(strategy)}


def _refusals(strategy):
    """TF's errors for a reduce inside run and an axis the value lacks, the same on threads and processes."""
    found = []
    for call in (lambda: strategy.run(lambda: strategy.reduce(ReduceOp.SUM, torch.tensor(1.0), axis=None)),
                 lambda: strategy.reduce("SUM", strategy.run(lambda: torch.tensor(1.0)), axis=0),
                 lambda: strategy.reduce("SUM", strategy.run(lambda: torch.arange(4.0)), axis=5)):
        try:
            call()
            found.append("not refused")
        except (RuntimeError, ValueError) as exc:
            found.append(f"{type(exc).__name__}: {str(exc).split(' (')[0]}")
    return found


REFUSED = ["RuntimeError: Method requires being in cross-replica context, use get_replica_context().merge_call()",
           "ValueError: Invalid reduction dimension 0 for input with 0 dimensions",
           "ValueError: Invalid reduction dimension 5 for input with 1 dimensions"]


def test_a_reduce_inside_run_and_an_axis_the_value_lacks_get_tfs_errors(strategy):
    """Inside run a reduce got a misleading 'non-DistributedValues' error on threads and succeeded across processes;
    axis=0 of a per-replica scalar loss raised a bare IndexError from dlaunch's internals."""
    assert _refusals(strategy) == REFUSED
    assert int(strategy.reduce("SUM", strategy.run(lambda: torch.arange(4.0)), axis=-1)) == 12
    with pytest.raises(ValueError, match="^Invalid reduction dimension 0 for input with 0 dimensions"):  # numpy too
        strategy.reduce("SUM", strategy.run(lambda: np.float32(1.0)), axis=0)  # (an IndexError from within)


@pytest.mark.slow
def test_a_processs_plain_tensor_is_reduced_over_the_processes_as_tfs_multi_worker_strategies_do():
    """It came back as this rank's own ([0.0] on rank 0, [1.0] on rank 1), while gather collected both: a ported
    accelerator.reduce(t, "mean") gave each rank its own value, exit 0. axis=0 of a value already reduced stays local."""
    from launcher.launch.function import run_function

    for rank, found in run_function(reduce_plain_tensors, device="cpu", nproc=2).items():
        assert found == {"mean": [0.5], "sum": [1.0], "nest": [0.5], "again": 28, "gather": [0.0, 1.0], "refused": REFUSED}, (rank, found)


def seed_example_over_a_dataloader():
    from torch.utils.data import DataLoader, TensorDataset

    from launcher import distribute as dl

    strategy = dl.MirroredStrategy()
    loader = DataLoader(TensorDataset(torch.arange(14)), batch_size=8, shuffle=False, drop_last=False)
    steps = []
    for x in strategy.experimental_distribute_dataset(loader):
        v = strategy.run(lambda batch: batch[0], args=(x,))
        steps.append((strategy.experimental_local_results(v)[0].tolist(), int(strategy.reduce(ReduceOp.SUM, v, axis=0)),
                      float(strategy.reduce(ReduceOp.MEAN, v, axis=0))))
    return steps


@pytest.mark.slow
def test_seed_example_over_a_dataloader_in_processes():
    """The seed's global batches of 8 then 6 rows (range(14)), each process loading its own rows: [0..3] | [4..7],
    then [8..11] | [12, 13]; SUM 28 and 63; MEAN over the 6 rows of the partial batch, 10.5, not a mean of means."""
    from launcher.launch.function import run_function

    results = run_function(seed_example_over_a_dataloader, device="cpu", nproc=2)
    assert results[0] == [([0, 1, 2, 3], 28, 3.5), ([8, 9, 10, 11], 63, 10.5)]
    assert results[1] == [([4, 5, 6, 7], 28, 3.5), ([12, 13], 63, 10.5)]
