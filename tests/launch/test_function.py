"""``run_function``: a function on two real gloo worker processes."""

from __future__ import annotations

import pytest

from launcher.launch.function import WorkerFailed, run_function

pytestmark = pytest.mark.slow


def whoami():
    from launcher.cluster.env import WorkerEnv

    env = WorkerEnv.from_environ()
    return {"rank": env.rank, "world": env.world_size, "addr": env.master_addr}


def raises_on_rank_1():
    from launcher.cluster.env import WorkerEnv

    if WorkerEnv.from_environ().rank == 1:
        raise ValueError("rank one says no")
    return 0


def test_each_rank_returns_its_result():
    results = run_function(whoami, device="cpu", nproc=2)
    assert results == {0: {"rank": 0, "world": 2, "addr": "127.0.0.1"}, 1: {"rank": 1, "world": 2, "addr": "127.0.0.1"}}


def test_a_raising_rank_is_the_root_cause():
    with pytest.raises(WorkerFailed) as info:
        run_function(raises_on_rank_1, device="cpu", nproc=2)
    assert info.value.root.rank == 1
    assert "ValueError: rank one says no" in info.value.root.exception


def chosen_device():
    from launcher import distribute as dl

    strategy = dl.MirroredStrategy()
    return strategy.extended.worker_devices[0]


def test_the_caller_chooses_the_workers_device():
    """device="cpu" holds on a GPU machine too: two processes on one GPU would otherwise both want cuda:N."""
    assert run_function(chosen_device, device="cpu", nproc=2) == {0: "cpu:0", 1: "cpu:0"}
