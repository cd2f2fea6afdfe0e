"""MirroredStrategy across real processes (gloo, loopback), one replica per process."""

from __future__ import annotations

import pytest
import torch

from launcher.launch.function import run_function
from tests.conftest import train_briefly

pytestmark = pytest.mark.slow


def seed_numbers():
    from launcher import distribute as dl

    s = dl.MirroredStrategy()
    out = {"replicas": s.num_replicas_in_sync, "resolver": s.cluster_resolver is not None, "steps": []}
    for i, x in enumerate(s.experimental_distribute_dataset([torch.arange(8), torch.arange(6)])):
        v = s.run(lambda t: t, args=(x,))
        step = {
            "local": s.experimental_local_results(v),
            "sum_axis0": s.reduce(dl.ReduceOp.SUM, v, axis=0),
            "mean_axis0": s.reduce(dl.ReduceOp.MEAN, v, axis=0),
            "gather": s.gather(v, axis=0),
        }
        if i == 0:  # the full batch: equal shapes, so axis=None works
            step["sum_none"] = s.reduce(dl.ReduceOp.SUM, v, axis=None)
            step["sum_again"] = s.reduce(dl.ReduceOp.SUM, step["sum_none"], axis=0)
        out["steps"].append(step)
    return out


def test_seed_numbers_across_two_processes():
    results = run_function(seed_numbers, device="cpu", nproc=2)
    for rank in (0, 1):
        r = results[rank]
        assert r["replicas"] == 2 and r["resolver"]
        full, partial = r["steps"]
        assert torch.equal(full["sum_none"], torch.tensor([4, 6, 8, 10]))
        assert int(full["sum_axis0"]) == 28 and int(full["sum_again"]) == 28
        assert torch.equal(full["gather"], torch.arange(8))
        assert float(partial["mean_axis0"]) == pytest.approx(15 / 6)  # denominator 6
        assert torch.equal(partial["gather"], torch.arange(6))
    assert torch.equal(results[0]["steps"][0]["local"][0], torch.tensor([0, 1, 2, 3]))
    assert torch.equal(results[1]["steps"][0]["local"][0], torch.tensor([4, 5, 6, 7]))
    assert torch.equal(results[0]["steps"][1]["local"][0], torch.tensor([0, 1, 2, 3]))
    assert torch.equal(results[1]["steps"][1]["local"][0], torch.tensor([4, 5]))


def replica_context_ops():
    from launcher import distribute as dl

    s = dl.MirroredStrategy()

    def fn():
        ctx = dl.get_replica_context()
        me = torch.tensor([float(ctx.replica_id_in_sync_group + 1)])
        merged = ctx.merge_call(lambda strategy, v: strategy.reduce("SUM", v, axis=None), args=(me,))
        return ctx.all_reduce("SUM", me), ctx.all_reduce("MEAN", me), ctx.all_gather(me, axis=0), merged

    total, mean, gathered, merged = (s.experimental_local_results(v)[0] for v in s.run(fn))
    contexts = []
    s.distribute_datasets_from_function(lambda ctx: contexts.append(repr(ctx)) or [])
    return {"total": total, "mean": mean, "gathered": gathered, "merged": merged, "contexts": contexts}


def test_replica_context_collectives_and_input_contexts():
    results = run_function(replica_context_ops, device="cpu", nproc=2)
    for rank, r in results.items():
        assert torch.equal(r["total"], torch.tensor([3.0])) and torch.equal(r["mean"], torch.tensor([1.5]))
        assert torch.equal(r["gathered"], torch.tensor([1.0, 2.0])) and torch.equal(r["merged"], torch.tensor([3.0]))
        assert r["contexts"] == [f"InputContext(num_input_pipelines=2, input_pipeline_id={rank}, num_replicas_in_sync=2)"]


def ddp_training_keeps_replicas_identical():
    import torch.distributed as dist

    from launcher import distribute as dl

    s = dl.MirroredStrategy()
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different init on purpose: DDP must broadcast rank 0's parameters
    with s.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def flat():
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    def same_everywhere():
        mine = flat()
        everyone = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(everyone, mine)
        return torch.equal(everyone[0], everyone[1])

    checks = [same_everywhere()]
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(5)]

    def step(batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for batch in s.experimental_distribute_dataset(data):
        s.run(step, args=(batch,))
        checks.append(same_everywhere())
    return checks


def test_parameters_identical_at_start_and_after_every_step():
    results = run_function(ddp_training_keeps_replicas_identical, device="cpu", nproc=2)
    assert results[0] == results[1] == [True] * 6


def mismatched_shapes(op_name):
    from launcher import distribute as dl

    s = dl.MirroredStrategy(cross_device_ops={"default": None, "gloo": dl.NcclAllReduce()}[op_name])
    _, batch = list(s.experimental_distribute_dataset([torch.arange(8), torch.arange(6)]))  # then 4 rows and 2 rows
    try:
        s.reduce(dl.ReduceOp.SUM, batch, axis=None)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("op_name", ["default", "gloo"])  # the shape check through shared memory, and through gloo
def test_reduce_without_axis_on_unequal_shapes_is_a_clear_error_on_every_process(op_name):
    results = run_function(mismatched_shapes, device="cpu", nproc=2, args=(op_name,))
    assert all("different shapes across processes" in r for r in results.values()), results


def _counting(cls, **kwargs):
    """``cls(**kwargs)`` that counts the gradient buckets DDP hands to its comm hook."""

    class Counting(cls):
        buckets = 0

        def _reduce_bucket(self, state, bucket):
            self.buckets += 1
            return super()._reduce_bucket(state, bucket)

    return Counting(**kwargs)


def ddp_with_each_cross_device_op():
    """Train the same model under each op (4 processes; hierarchical as 2 nodes x 2 ranks)."""
    import torch.distributed as dist

    from launcher import distribute as dl

    ops = {
        "default": None,
        "nccl_all_reduce": dl.NcclAllReduce(),
        "hierarchical_copy": _counting(dl.HierarchicalCopyAllReduce, ranks_per_node=2),
        "reduction_to_one_device": _counting(dl.ReductionToOneDevice, root_rank=1),
        "shared_memory": _counting(dl.SharedMemoryAllReduce),
    }
    out = {}
    for name, op in ops.items():
        s = dl.MirroredStrategy(cross_device_ops=op)
        model = train_briefly(s, steps=5, seed=dist.get_rank())  # DDP broadcasts rank 0's parameters
        out[name] = {
            "params": torch.cat([p.detach().flatten() for p in model.parameters()]),
            "hooked": s.extended._cross_device_ops._ddp_comm_hook() is not None,
            "buckets": getattr(op, "buckets", 0),
        }
    return out


def test_ddp_comm_hooks_train_like_ddps_own_all_reduce():
    results = run_function(ddp_with_each_cross_device_op, device="cpu", nproc=4)
    reference = results[0]["nccl_all_reduce"]["params"]  # DDP's own all-reduce (gloo)
    for rank, r in results.items():
        # The default between CPU processes of one machine: shared memory, as a comm hook.
        assert [name for name, v in r.items() if not v["hooked"]] == ["nccl_all_reduce"]
        for name in ("hierarchical_copy", "reduction_to_one_device", "shared_memory"):
            assert r[name]["buckets"] >= 5, name  # every step
        for name, v in r.items():
            torch.testing.assert_close(v["params"], reference, rtol=1e-6, atol=1e-7, msg=f"rank {rank}, {name}")
