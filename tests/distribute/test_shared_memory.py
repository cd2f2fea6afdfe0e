"""The shared-memory all-reduce: real processes (torch.distributed.elastic, gloo), compared with gloo's own."""

from __future__ import annotations

import os

import pytest
import torch

from launcher import distribute as dl
from launcher.cluster.env import WorkerEnv
from launcher.cluster.process_group import ensure_process_group
from launcher.distribute import shared_memory
from launcher.launch.function import run_function
from tests.conftest import train_briefly

pytestmark = pytest.mark.skipif(not shared_memory.SharedMemoryGroup.supported(), reason="needs x86-64 and /dev/shm")


def test_parts_cover_the_tensor_without_overlap_at_cache_line_bounds():
    for numel in (0, 1, 15, 16, 17, 1000, 1863690):
        for world in (1, 2, 3, 8):
            parts = [shared_memory._part(numel, r, world) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            assert all(lo % 16 == 0 for lo, hi in parts if hi > lo)


def test_slot_size_is_page_aligned_and_within_the_budget():
    assert shared_memory._slot_bytes(48 * 2**20, 2) == 16 * 2**20
    assert shared_memory._slot_bytes(10_000_000, 3) % shared_memory.ALIGN == 0
    assert shared_memory._slot_bytes(1, 8) == shared_memory.ALIGN


def sums_like_gloo(budget_bytes: int):
    """Every dtype and size, in chunks when larger than a slot; the same bits as gloo for 2 ranks."""
    import torch.distributed as dist

    ensure_process_group(WorkerEnv.from_environ())
    group = shared_memory.SharedMemoryGroup.create(None, budget_bytes, timeout_s=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"segments_left": [n for n in os.listdir(shared_memory.SHM_DIR) if n.startswith(f"dlaunch-{os.getpid()}-")]}
    gen = torch.Generator().manual_seed(rank)
    cases = {
        "float32_big": torch.randn(1_000_003, generator=gen),  # several chunks with a small budget
        "float64": torch.randn(333, generator=gen, dtype=torch.float64),
        "int64": torch.arange(10, dtype=torch.int64) * (rank + 1),
        "bfloat16": torch.randn(77, generator=gen).to(torch.bfloat16),
        "matrix": torch.randn(64, 33, generator=gen),
        "one": torch.tensor([rank + 0.5]),
        "empty": torch.zeros(0),
    }
    for name, x in cases.items():
        mine, theirs = x.clone(), x.clone()
        group.all_reduce_(mine)
        dist.all_reduce(theirs)
        out[name] = (mine, theirs)
    mean, summed = cases["float32_big"].clone(), cases["float32_big"].clone()
    group.all_reduce_(mean, divide_by=world)  # each rank divides its share of the sum
    dist.all_reduce(summed)
    out["mean"] = (mean, summed / world)
    repeated = torch.full((5,), float(rank))
    for _ in range(50):  # counters keep moving; no stale slot is read
        group.all_reduce_(repeated)
        repeated.div_(world)
    out["repeated"] = repeated
    out["world"] = world
    return out


@pytest.mark.slow
@pytest.mark.parametrize("nproc,budget", [(2, 1_000_000), (3, 48 * 2**20)])
def test_all_reduce_equals_gloo(nproc, budget):
    results = run_function(sums_like_gloo, device="cpu", nproc=nproc, args=(budget,))
    for rank, r in results.items():
        assert r.pop("segments_left") == [], "the segment is unlinked once every rank has mapped it"
        world = r.pop("world")
        mean_of_ranks = sum(range(world)) / world
        torch.testing.assert_close(r.pop("repeated"), torch.full((5,), mean_of_ranks))
        for name, (mine, theirs) in r.items():
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, name
            if world == 2:
                assert torch.equal(mine, theirs), name  # one addition: the same bits
            else:
                tol = 3e-2 if mine.dtype == torch.bfloat16 else 1e-5  # another order of additions: a last-bit difference
                torch.testing.assert_close(mine, theirs, rtol=tol, atol=tol)
        assert torch.equal(r["int64"][0], torch.arange(10) * sum(range(1, world + 1)))


def default_op_and_training():
    """The default op between CPU processes of one machine is shared memory; it trains as gloo does."""
    import torch.distributed as dist

    default = dl.MirroredStrategy()
    gloo = dl.MirroredStrategy(cross_device_ops=dl.NcclAllReduce())  # the plain all-reduce: gloo on CPU
    explicit = dl.MirroredStrategy(cross_device_ops=dl.SharedMemoryAllReduce(budget_mb=0.5))  # chunked buckets
    params = {}
    for name, s in (("default", default), ("gloo", gloo), ("explicit", explicit)):
        model = train_briefly(s, steps=6)
        params[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "default_op": type(default.extended._cross_device_ops).__name__,
        "gloo_op": type(gloo.extended._cross_device_ops).__name__,
        "hook": default.extended._cross_device_ops._ddp_comm_hook() is not None,
        "params": params,
        "rank": dist.get_rank(),
    }


@pytest.mark.slow
def test_default_between_cpu_processes_is_shared_memory_and_trains_bit_for_bit_like_gloo():
    results = run_function(default_op_and_training, device="cpu", nproc=2)
    for r in results.values():
        assert r["default_op"] == "SharedMemoryAllReduce" and r["hook"]
        assert r["gloo_op"] == "NcclAllReduce"
        assert torch.equal(r["params"]["default"], r["params"]["gloo"])
        assert torch.equal(r["params"]["explicit"], r["params"]["gloo"])
    assert torch.equal(results[0]["params"]["default"], results[1]["params"]["default"])


def a_peer_that_never_arrives():
    import torch.distributed as dist

    ensure_process_group(WorkerEnv.from_environ())
    group = shared_memory.SharedMemoryGroup.create(None, 2**20, timeout_s=1.5)
    if dist.get_rank() == 1:
        import time

        time.sleep(4)  # alive, but never arriving
        return "stayed away"
    try:
        group.all_reduce_(torch.ones(4))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_missing_peer_is_a_timeout_naming_it():
    results = run_function(a_peer_that_never_arrives, device="cpu", nproc=2)
    assert "Timed out waiting 2 s for rank 1" in results[0]
    assert results[1] == "stayed away"


def a_peer_that_exits():
    import time

    import torch.distributed as dist

    ensure_process_group(WorkerEnv.from_environ())
    group = shared_memory.SharedMemoryGroup.create(None, 2**20, timeout_s=120)
    if dist.get_rank() == 1:
        return "left"  # and its process ends
    started = time.monotonic()
    try:
        group.all_reduce_(torch.ones(4))
    except RuntimeError as exc:
        return (str(exc), time.monotonic() - started)
    return ("no error", 0.0)


@pytest.mark.slow
def test_a_peer_that_exits_is_an_error_at_once_not_after_the_timeout():
    # fresh workers: a warm one that returned stays until every rank has returned (torch elastic's function workers)
    results = run_function(a_peer_that_exits, device="cpu", nproc=2, warm=False)
    message, waited = results[0]
    assert "rank 1" in message and "has exited" in message
    assert waited < 60  # the timeout is 120 s
    assert results[1] == "left"


def test_a_group_without_shared_memory_falls_back_or_raises(monkeypatch):
    """Where the segment cannot be made the default keeps gloo, and an explicit request is an error."""
    import torch.distributed as dist

    from launcher.distribute import cross_device_ops as cdo
    from launcher.distribute.collectives import ProcessCollectives

    monkeypatch.setattr(shared_memory.SharedMemoryGroup, "supported", staticmethod(lambda: False))
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        processes = ProcessCollectives()
        assert type(cdo.for_processes(None, processes, None, torch.device("cpu"))) is cdo.CrossDeviceOps
        with pytest.raises(ValueError, match="needs every process of the group on one machine"):
            cdo.for_processes(dl.SharedMemoryAllReduce(), processes, None, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
