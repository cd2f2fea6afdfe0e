"""Cross-device ops: every op gives the seeds' numbers, in one process (thread replicas) and across processes."""

from __future__ import annotations

import threading
import typing

import pytest
import torch

from launcher import distribute as dl
from launcher.config.schema import MirroredSpec
from launcher.distribute import PerReplica, ReduceOp
from launcher.distribute import cross_device_ops as cdo
from launcher.launch.function import run_function
from tests.conftest import train_briefly

OPS = {
    "default": lambda: None,
    "nccl_all_reduce": dl.NcclAllReduce,
    "hierarchical_copy": dl.HierarchicalCopyAllReduce,
    "reduction_to_one_device": dl.ReductionToOneDevice,
    "shared_memory": dl.SharedMemoryAllReduce,
}


@pytest.fixture(params=list(OPS))
def threaded(request, monkeypatch):
    """A two-replica MirroredStrategy in this process with each op."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    s = dl.MirroredStrategy(devices=["cpu:0", "cpu:1"], cross_device_ops=OPS[request.param]())
    yield s
    if s.extended._threads is not None:
        s.extended._threads.close()


def _seed_value(strategy):
    (x,) = strategy.experimental_distribute_dataset([torch.arange(8)])
    return strategy.run(lambda t: t, args=(x,))


# ---------- names and construction ----------
def test_config_names_are_the_ops_names():
    allowed = typing.get_args(typing.get_args(MirroredSpec.model_fields["cross_device_ops"].annotation)[0])
    assert {cdo.from_name(n).name for n in allowed} == set(allowed)
    assert [type(cdo.from_name(n)) for n in allowed] == [
        dl.NcclAllReduce, dl.HierarchicalCopyAllReduce, dl.ReductionToOneDevice, dl.SharedMemoryAllReduce,
    ]
    assert cdo.from_name(None) is None


def test_unknown_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="allowed: nccl_all_reduce, hierarchical_copy, reduction_to_one_device, shared_memory"):
        cdo.from_name("ring")


@pytest.mark.parametrize("make", [
    lambda: dl.NcclAllReduce(num_packs=-1),
    lambda: dl.HierarchicalCopyAllReduce(ranks_per_node=0),
    lambda: dl.ReductionToOneDevice(root_rank=-1),
    lambda: dl.ReductionToOneDevice(reduce_to_device="tpu:0"),
    lambda: dl.SharedMemoryAllReduce(budget_mb=0),
])
def test_bad_arguments_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


def test_reduce_to_device_takes_tf_device_names():
    assert dl.ReductionToOneDevice("/GPU:1").reduce_to_device == "cuda:1"
    assert dl.ReductionToOneDevice().reduce_to_device is None


# ---------- thread replicas: the seeds' numbers with every op ----------
def test_reduce_gives_the_seed_numbers(threaded):
    v = _seed_value(threaded)
    assert torch.equal(threaded.reduce(ReduceOp.SUM, v, axis=None), torch.tensor([4, 6, 8, 10]))
    torch.testing.assert_close(threaded.reduce(ReduceOp.MEAN, v, axis=None), torch.tensor([2.0, 3.0, 4.0, 5.0]))
    assert torch.equal(threaded.reduce(ReduceOp.SUM, v, axis=0), torch.tensor(28))
    torch.testing.assert_close(threaded.reduce(ReduceOp.MEAN, v, axis=0), torch.tensor(3.5))


def test_reduce_to_and_batch_reduce_to_give_the_seed_numbers(threaded):
    v = _seed_value(threaded)
    ext = threaded.extended
    assert torch.equal(ext.reduce_to(ReduceOp.SUM, v, "cpu:0"), torch.tensor([4, 6, 8, 10]))
    mirrored = ext.reduce_to("mean", v, v)  # destinations: the per-replica value's devices
    assert isinstance(mirrored, PerReplica) and len(mirrored) == 2
    for component in mirrored.values:
        torch.testing.assert_close(component, torch.tensor([2.0, 3.0, 4.0, 5.0]))
    w = PerReplica([torch.tensor([[1.5]]), torch.tensor([[2.5]])])
    total, w_total, again = ext.batch_reduce_to(ReduceOp.SUM, [(v, "cpu:0"), (w, None), (v, "cpu:1")])
    assert torch.equal(total, torch.tensor([4, 6, 8, 10])) and torch.equal(again, total)
    assert torch.equal(w_total, torch.tensor([[4.0]]))


def test_reduce_to_of_a_plain_value_follows_strategy_reduce(threaded):
    ext = threaded.extended
    assert torch.equal(ext.reduce_to(ReduceOp.MEAN, torch.tensor([1.0, 2.0]), "cpu:0"), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="cannot be reduced"):
        ext.reduce_to(ReduceOp.SUM, torch.tensor([1.0, 2.0]), "cpu:0")


def test_replica_context_all_reduce(threaded):
    x = PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    out = threaded.run(lambda t: dl.get_replica_context().all_reduce(ReduceOp.SUM, t), args=(x,))
    for v in out.values:
        assert torch.equal(v, torch.tensor([4.0, 6.0]))


def _train(strategy):
    model = train_briefly(strategy)
    return [torch.cat([p.detach().flatten() for p in replica.parameters()]) for replica in model.replicas]


def test_thread_training_equals_the_default(threaded, monkeypatch):
    default = dl.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    try:
        expected = _train(default)
    finally:
        default.extended._threads.close()
    got = _train(threaded)
    assert torch.equal(got[0], got[1])  # the copies stay identical
    assert torch.equal(got[0], expected[0])  # the same additions in the same order: the same bits


def test_reduction_to_one_device_sums_on_one_thread_with_its_accumulation_fn(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    threads = []

    def accumulate(tensors):
        threads.append(threading.current_thread().name)
        return torch.stack(tensors).sum(dim=0)  # another order of additions than the default

    s = dl.MirroredStrategy(devices=["cpu:0", "cpu:1"], cross_device_ops=dl.ReductionToOneDevice("cpu:0", accumulate))
    try:
        got = _train(s)
    finally:
        s.extended._threads.close()
    default = dl.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    try:
        expected = _train(default)
    finally:
        default.extended._threads.close()
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-7)
    assert len(threads) == 4 * 4  # 4 steps x 4 parameter tensors
    assert set(threads) == {threading.main_thread().name}  # replica 0 runs on the calling thread


# ---------- the public CrossDeviceOps methods ----------
@pytest.mark.parametrize("name", list(OPS)[1:])
def test_public_reduce_batch_reduce_and_broadcast(name):
    op = OPS[name]()
    v = PerReplica([torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])])
    assert torch.equal(op.reduce(ReduceOp.SUM, v, destinations="cpu:0"), torch.tensor([4, 6, 8, 10]))
    copies = op.reduce("mean", v, destinations=["cpu:0", "cpu:1"])
    copies.values[0].add_(100)  # one copy per destination, not aliases
    torch.testing.assert_close(copies.values[1], torch.tensor([2.0, 3.0, 4.0, 5.0]))
    total, twos = op.batch_reduce(ReduceOp.SUM, [(v, None), (PerReplica([torch.ones(2), torch.ones(2)]), "cpu:0")])
    assert torch.equal(total, torch.tensor([4, 6, 8, 10])) and torch.equal(twos, torch.tensor([2.0, 2.0]))
    source = torch.tensor([1.0])
    out = op.broadcast(source, "cpu:0")
    out.add_(1)
    assert torch.equal(source, torch.tensor([1.0]))


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@needs_two_gpus
@pytest.mark.parametrize("name", list(OPS)[1:])
def test_cuda_thread_replicas_train_like_the_default(name):
    expected = _train(dl.MirroredStrategy(devices=["cuda:0", "cuda:1"]))
    got = _train(dl.MirroredStrategy(devices=["cuda:0", "cuda:1"], cross_device_ops=OPS[name]()))
    torch.testing.assert_close(got[0].cpu(), expected[0].cpu())
    torch.testing.assert_close(got[1].cpu(), got[0].cpu())


# ---------- across processes (real gloo) ----------
def every_op_across_processes():
    """The seeds' numbers under each op, in one process group (2 processes)."""
    results = {}
    for name, make in OPS.items():
        s = dl.MirroredStrategy(cross_device_ops=make())
        v = _seed_value(s)
        w = s.run(lambda: torch.tensor([float(dl.get_replica_context().replica_id_in_sync_group) + 0.25]))
        results[name] = {
            "sum": s.reduce(ReduceOp.SUM, v, axis=None),
            "mean": s.reduce(ReduceOp.MEAN, v, axis=None),
            "sum_axis0": s.reduce(ReduceOp.SUM, v, axis=0),
            "reduce_to": s.extended.reduce_to(ReduceOp.SUM, v, "cpu:0"),
            "batch": s.extended.batch_reduce_to(ReduceOp.MEAN, [(v, "cpu:0"), (w, "cpu:0")]),
            "public": s.extended._cross_device_ops.reduce(ReduceOp.SUM, v, "cpu:0"),
            "ctx": s.experimental_local_results(s.run(lambda t: dl.get_replica_context().all_reduce("sum", t), args=(w,)))[0],
        }
    workers = dl.MultiWorkerMirroredStrategy(cross_device_ops=dl.ReductionToOneDevice(root_rank=1))
    results["multi_worker"] = {"sum": workers.reduce(ReduceOp.SUM, _seed_value(workers), axis=None)}
    return results


@pytest.mark.slow
def test_every_op_gives_the_seed_numbers_across_two_processes():
    results = run_function(every_op_across_processes, device="cpu", nproc=2)
    for rank in (0, 1):
        assert torch.equal(results[rank].pop("multi_worker")["sum"], torch.tensor([4, 6, 8, 10]))
        for name, r in results[rank].items():
            assert torch.equal(r["sum"], torch.tensor([4, 6, 8, 10])), name
            assert torch.equal(r["mean"], torch.tensor([2.0, 3.0, 4.0, 5.0])), name
            assert int(r["sum_axis0"]) == 28, name
            assert torch.equal(r["reduce_to"], torch.tensor([4, 6, 8, 10])), name
            assert torch.equal(r["public"], torch.tensor([4, 6, 8, 10])), name
            assert torch.equal(r["batch"][0], torch.tensor([2.0, 3.0, 4.0, 5.0])), name
            assert torch.equal(r["batch"][1], torch.tensor([0.75])), name  # (0.25 + 1.25) / 2
            assert torch.equal(r["ctx"], torch.tensor([1.5])), name


def two_nodes_of_two():
    """4 processes as 2 "nodes" x 2 ranks: hierarchical runs in real subgroups and equals the plain all-reduce."""
    import torch.distributed as dist

    hierarchical = dl.HierarchicalCopyAllReduce(ranks_per_node=2)
    s = dl.MirroredStrategy(cross_device_ops=hierarchical)  # joins the process group and builds the subgroups
    rank = dist.get_rank()
    topo = hierarchical.topology()
    one_node = dl.HierarchicalCopyAllReduce()  # the worker env: every rank on node 0
    dl.MirroredStrategy(cross_device_ops=one_node)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    plain = x.clone()
    dist.all_reduce(plain)
    pairs = [(PerReplica([x]), None), (PerReplica([torch.arange(5) * (rank + 1)]), None), (PerReplica([x[:7] * 3]), None)]
    return {
        "nodes": topo.nodes,
        "node_size": dist.get_world_size(topo.node_group),
        "leaders": None if topo.leaders_group is None else dist.get_process_group_ranks(topo.leaders_group),
        "one_node": one_node.topology().nodes,
        "one_node_leaders": one_node.topology().leaders_group is None,
        "plain": plain,
        "hierarchical": s.reduce(ReduceOp.SUM, PerReplica([x]), axis=None),
        "one_node_sum": one_node.reduce(ReduceOp.SUM, x),
        "root_3": dl.ReductionToOneDevice(root_rank=3).reduce(ReduceOp.MEAN, x),
        "packed": dl.NcclAllReduce(num_packs=2).batch_reduce(ReduceOp.SUM, pairs),
        "unpacked": dl.NcclAllReduce(num_packs=0).batch_reduce(ReduceOp.SUM, pairs),
        "hierarchical_packed": hierarchical.batch_reduce(ReduceOp.SUM, pairs),
    }


@pytest.mark.slow
def test_hierarchical_on_two_nodes_of_two_ranks_uses_subgroups_and_equals_all_reduce():
    results = run_function(two_nodes_of_two, device="cpu", nproc=4)
    plain = results[0]["plain"]
    for rank, r in results.items():
        assert r["nodes"] == ((0, 1), (2, 3)) and r["node_size"] == 2
        assert r["leaders"] == ([0, 2] if rank in (0, 2) else None)
        assert r["one_node"] == ((0, 1, 2, 3),) and r["one_node_leaders"]
        for key in ("plain", "hierarchical", "one_node_sum"):
            torch.testing.assert_close(r[key], plain, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["root_3"], plain / 4, rtol=1e-6, atol=1e-6)
        for packed in (r["packed"], r["hierarchical_packed"]):
            torch.testing.assert_close(packed[0], plain, rtol=1e-6, atol=1e-6)
            assert torch.equal(packed[1], torch.arange(5) * 10)  # 1 + 2 + 3 + 4
            for got, want in zip(packed, r["unpacked"]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
