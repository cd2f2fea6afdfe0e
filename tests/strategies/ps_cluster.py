"""Real parameter-server clusters for tests: one spawned process per task, each with its own TF_CONFIG."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch.multiprocessing as mp

from launcher.launch.rendezvous import free_port


def cluster_spec(workers: int, ps: int) -> dict[str, list[str]]:
    """A chief on a free loopback port; the other tasks' addresses are placeholders (they meet at the chief's)."""
    port = free_port()
    return {"chief": [f"127.0.0.1:{port}"], "worker": [f"127.0.0.1:{1 + i}" for i in range(workers)],
            "ps": [f"127.0.0.1:{100 + i}" for i in range(ps)]}


def enter_task(kind: str, index: int, cluster: dict) -> None:
    """In a task's process: its TF_CONFIG, and TensorPipe and gloo on loopback."""
    os.environ.update(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}}),
                      TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo")


def enter_or_serve(kind: str, index: int, cluster: dict) -> bool:
    """Enter the task; a ps task then serves until the job ends (True: nothing left for the caller to do)."""
    enter_task(kind, index, cluster)
    if kind != "ps":
        return False
    from launcher import distribute as dl
    from launcher.cluster import rpc

    dl.Server(cluster, "ps", index).join()
    rpc.shutdown()
    return True


def end_training_task(strategy: Any, kind: str) -> None:
    """The chief ends the job; a worker leaves it; then the RPC endpoint goes."""
    from launcher.cluster import rpc

    if kind == "chief":
        strategy.extended.finish()
    else:
        strategy.extended.leave()
    rpc.shutdown()


def run_cluster(target: Callable[..., None], cluster: dict, args: tuple = (), timeout_s: float = 180,
                train: bool = True) -> tuple[dict, list[int]]:
    """``target(kind, index, cluster, *args, results)`` on every task; returns ({key: result}, exit codes).

    Only the tasks that train (with ``train=True``) put a result (``(key, value)``) on ``results``;
    with ``train=False`` only the chief does (the workers serve a coordinator).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tasks = [(kind, i) for kind in ("chief", "worker", "ps") for i in range(len(cluster.get(kind, [])))]
    procs = [ctx.Process(target=target, args=(kind, i, cluster, *args, results)) for kind, i in tasks]
    for p in procs:
        p.start()
    training = sum(1 for kind, _ in tasks if kind != "ps") if train else 1
    got = dict(results.get(timeout=timeout_s) for _ in range(training))
    for p in procs:
        p.join(timeout=60)
    return got, [p.exitcode for p in procs]
