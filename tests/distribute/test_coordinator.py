"""ClusterCoordinator on a real cluster (chief, 2 workers, 1 ps): schedule, join, fetch, per-worker datasets, a worker's death."""

from __future__ import annotations

import os

import pytest
import torch.multiprocessing as mp

from tests.strategies.ps_cluster import cluster_spec, enter_task, run_cluster

pytestmark = pytest.mark.slow


def square(x: int) -> tuple[int, str]:
    import torch.distributed.rpc as trpc

    return x * x, trpc.get_worker_info().name


def die_once_on_worker_1(flag: str, x: int) -> tuple[int, str]:
    """worker:1 exits the first time it runs this; the function must then run again elsewhere."""
    import torch.distributed.rpc as trpc

    if trpc.get_worker_info().name == "worker:1" and not os.path.exists(flag):
        open(flag, "w").close()
        os._exit(3)
    return square(x)


def dataset_fn() -> list[int]:
    return [10, 11, 12, 13]


def next_element(iterator) -> tuple[int, str]:
    import torch.distributed.rpc as trpc

    return next(iterator), trpc.get_worker_info().name


def fails(x: int) -> None:
    raise ValueError(f"bad input {x}")


def task(kind: str, index: int, cluster: dict, flag: str, results: mp.Queue) -> None:
    enter_task(kind, index, cluster)
    from launcher import distribute as dl
    from launcher.cluster import rpc

    if kind != "chief":
        dl.Server(cluster, kind, index).join()  # ps: serve variables; worker: serve the coordinator
        rpc.shutdown()
        return
    strategy = dl.ParameterServerStrategy()
    coordinator = dl.experimental.coordinator.ClusterCoordinator(strategy)
    per_worker_iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    elements = [coordinator.schedule(next_element, args=(per_worker_iterator,)) for _ in range(4)]
    coordinator.join()
    squares = [coordinator.schedule(die_once_on_worker_1, args=(flag, x)) for x in range(8)]
    coordinator.join()
    failed = coordinator.schedule(fails, args=(7,))
    try:
        coordinator.join()
        error = "no error"
    except Exception as exc:  # noqa: BLE001 - the function's own error, reported at join
        error = str(exc)
    out = {"elements": coordinator.fetch(elements), "squares": coordinator.fetch(squares), "join_error": error,
           "fetch_error": _error_of(failed.fetch)}
    coordinator.shutdown()
    strategy.extended.finish()
    results.put(("chief:0", out))
    rpc.shutdown()


def _error_of(call) -> str:
    try:
        call()
        return "no error"
    except Exception as exc:  # noqa: BLE001
        return str(exc)


def test_schedule_join_fetch_and_a_dead_workers_functions_run_elsewhere(tmp_path):
    got, exits = run_cluster(task, cluster_spec(workers=2, ps=1), (str(tmp_path / "died"),), timeout_s=240, train=False)
    out = got["chief:0"]
    assert exits[0] == 0 and exits[3] == 0  # the chief and the ps
    assert sorted(exits[1:3]) == [0, 3]  # worker:1 died in its function; worker:0 served to the end
    assert [v for v, _ in out["squares"]] == [x * x for x in range(8)]  # every function ran, one of them twice
    by_worker: dict[str, list[int]] = {}
    for value, worker in out["elements"]:
        by_worker.setdefault(worker, []).append(value)
    for values in by_worker.values():
        assert values == [10, 11, 12, 13][: len(values)]  # each worker reads its own dataset, in order
    assert "bad input 7" in out["join_error"] and "bad input 7" in out["fetch_error"]
