"""ReplicaContext collectives, Strategy.gather and experimental_local_results."""

import torch

from launcher.distribute import PerReplica, ReduceOp, get_replica_context


def _per_replica(*values):
    return PerReplica([torch.tensor(v) for v in values])


def test_all_reduce_sum_gives_every_replica_the_total(strategy):
    x = _per_replica([1.0, 2.0], [3.0, 4.0])
    out = strategy.run(lambda t: get_replica_context().all_reduce(ReduceOp.SUM, t), args=(x,))
    for v in out.values:
        assert torch.equal(v, torch.tensor([4.0, 6.0]))


def test_all_reduce_mean_divides_by_replicas(strategy):
    x = _per_replica([1.0, 2.0], [3.0, 4.0])
    out = strategy.run(lambda t: get_replica_context().all_reduce("mean", t), args=(x,))
    for v in out.values:
        torch.testing.assert_close(v, torch.tensor([2.0, 3.0]))


def test_all_reduce_of_a_nest(strategy):
    x = PerReplica([{"a": torch.tensor(1.0), "b": (torch.tensor([1]),)}, {"a": torch.tensor(5.0), "b": (torch.tensor([2]),)}])
    out = strategy.run(lambda t: get_replica_context().all_reduce(ReduceOp.SUM, t), args=(x,))
    for replica in strategy.experimental_local_results(out):
        assert torch.equal(replica["a"], torch.tensor(6.0))
        assert torch.equal(replica["b"][0], torch.tensor([3]))


def test_all_reduce_result_does_not_alias_the_inputs(strategy):
    inputs = [torch.tensor([1.0]), torch.tensor([2.0])]
    out = strategy.run(lambda t: get_replica_context().all_reduce(ReduceOp.SUM, t), args=(PerReplica(inputs),))
    out.values[0].add_(100)
    assert torch.equal(inputs[0], torch.tensor([1.0]))
    assert torch.equal(out.values[1], torch.tensor([3.0]))


def test_consecutive_all_reduces_do_not_mix_steps(strategy):
    def fn(t):
        ctx = get_replica_context()
        first = ctx.all_reduce(ReduceOp.SUM, t)
        second = ctx.all_reduce(ReduceOp.SUM, t * 10)
        return first, second

    out = strategy.run(fn, args=(_per_replica(1, 2),))
    assert out[0].values == (torch.tensor(3), torch.tensor(3))
    assert out[1].values == (torch.tensor(30), torch.tensor(30))


def test_all_gather_concatenates_along_axis_0_in_replica_order(strategy):
    x = _per_replica([1, 2, 3], [4])
    out = strategy.run(lambda t: get_replica_context().all_gather(t, axis=0), args=(x,))
    for v in out.values:
        assert torch.equal(v, torch.tensor([1, 2, 3, 4]))


def test_all_gather_along_axis_1(strategy):
    x = _per_replica([[1], [2]], [[3, 4], [5, 6]])
    out = strategy.run(lambda t: get_replica_context().all_gather(t, axis=1), args=(x,))
    for v in out.values:
        assert torch.equal(v, torch.tensor([[1, 3, 4], [2, 5, 6]]))


def test_gather_concatenates_unequal_per_replica_sizes(strategy):
    v = PerReplica([torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5, 6]])])
    assert torch.equal(strategy.gather(v, axis=0), torch.tensor([[1, 2], [3, 4], [5, 6]]))


def test_gather_of_a_last_partial_batch_restores_the_global_batch(strategy):
    _, last = list(strategy.experimental_distribute_dataset([torch.arange(8), torch.arange(6)]))
    out = strategy.run(lambda t: t * 2, args=(last,))
    assert torch.equal(strategy.gather(out, axis=0), torch.arange(6) * 2)


def test_local_results_of_per_replica_is_its_components(strategy):
    out = strategy.run(lambda: get_replica_context().replica_id_in_sync_group)
    assert strategy.experimental_local_results(out) == (0, 1)


def test_local_results_of_a_nest_is_one_nest_per_replica(strategy):
    out = strategy.run(lambda: {"id": get_replica_context().replica_id_in_sync_group, "k": "x"})
    assert strategy.experimental_local_results(out) == ({"id": 0, "k": "x"}, {"id": 1, "k": "x"})


def test_local_results_of_a_plain_value_is_a_one_tuple(strategy):
    t = torch.tensor(1.0)
    (only,) = strategy.experimental_local_results(t)
    assert only is t
