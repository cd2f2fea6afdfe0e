"""``Server``: one task's endpoint in a parameter-server cluster, and what a ps task holds.

As ``tf.distribute.Server``: ``Server(cluster_spec, job_name, task_index)``
starts this task's endpoint (torch.distributed.rpc over TensorPipe); a ps task
then calls ``join()`` and serves until the chief ends the job::

    cluster = {"chief": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"], "ps": ["127.0.0.1:2224"]}
    Server(cluster, job_name="ps", task_index=0).join()      # on the ps task's machine

A ps task holds its shards of the variables (``VariableStore``) and the
optimizer over them: workers pull values (whole, or only the embedding rows
they need), push gradients (dense, or sparse rows), and the ps applies them,
each push as it arrives (async) or once per step with one gradient from every
training task (sync, as ``SyncReplicasOptimizer``). The global step lives on
ps 0; the pushes that say so advance it (the strategy's ``global_step_rule``).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed.rpc as trpc

from launcher.checkpoint import shards  # here, not in the RPC handler: two handler threads importing DCP at once see a half-made module
from launcher.cluster import rpc
from launcher.cluster.resolvers import ClusterSpec
from launcher.distribute.ps_updates import StepReports, SyncRound, as_gradient

log = logging.getLogger("dlaunch")


class Server:
    """This task's endpoint in ``cluster`` (a dict of job -> addresses, or a ``ClusterSpec``).

    Args:
        server_or_cluster_def: the cluster: jobs ``chief``, ``worker`` and ``ps`` with ``host:port`` addresses.
        job_name: this task's job. Required unless the cluster has one task.
        task_index: this task's index in its job. Required unless the job has one task.
        start: start the endpoint now (else call ``start()``).
        protocol: TF's transport name. The transport is TensorPipe: None or ``"tensorpipe"``;
            anything else (``"grpc"``) is a ``ValueError``, not a silent substitute.
        config: TF's ``ConfigProto``. None only: there is no session to configure.
        rpc_timeout_s: an RPC that gets no answer in this time fails.

    The endpoints meet at the chief's address (the first task's when there is no
    chief); its store listens on that host only.
    """

    def __init__(self, server_or_cluster_def: Any, job_name: str | None = None, task_index: int | None = None,
                 protocol: str | None = None, config: Any = None, start: bool = True, *, rpc_timeout_s: float = 60.0):
        if protocol not in (None, "tensorpipe"):
            raise ValueError(f"protocol={protocol!r}: dlaunch's servers speak torch.distributed.rpc over TensorPipe; "
                             "pass protocol=None (or 'tensorpipe')")
        if config is not None:
            raise ValueError("config (a tf.ConfigProto) has no torch counterpart: pass config=None; RPC timeouts are "
                             "rpc_timeout_s")
        self._cluster = ClusterSpec(server_or_cluster_def)
        if not self._cluster:
            raise ValueError("Server needs a cluster spec with at least one task")
        self.job_name, self.task_index = _this_task(self._cluster, job_name, task_index)
        self._tasks = rpc.ordered({job: self._cluster.job_tasks(job) for job in self._cluster.jobs})
        self._rpc_timeout_s = rpc_timeout_s
        self._started = False
        if start:
            self.start()

    @property
    def target(self) -> str:
        """This task's address, as ``rpc://host:port``."""
        return "rpc://" + self._cluster.task_address(self.job_name, self.task_index)

    @property
    def name(self) -> str:
        return rpc.task_name(self.job_name, self.task_index)

    def start(self) -> None:
        """Start this task's endpoint; returns once every task of the cluster has started its own."""
        if self._started:
            return
        first = "chief" if "chief" in self._cluster.jobs else self._tasks[0][0]
        host, port = self._cluster.task_address(first, 0).rsplit(":", 1)
        rank = self._tasks.index((self.job_name, self.task_index))
        if self.job_name == "ps":
            serve(self.task_index)
        rpc.start(self.name, rank, len(self._tasks), host.strip("[]"), int(port), self._rpc_timeout_s)
        self._started = True

    def join(self, poll_s: float = 0.2) -> None:
        """Block until the job ends: the chief has finished and every training task has left or is gone.

        A worker joins to serve a ``ClusterCoordinator``: it returns when the coordinator releases it.
        """
        store = _STORE.get("store")
        if store is None and self.job_name == "worker":
            from launcher.distribute import coordinator

            coordinator.wait_for_release()
            return
        if store is None:
            raise RuntimeError(f"{self.name} holds no variables: only ps tasks and coordinated workers join; the chief trains")
        store.finished.wait()
        store.drain(self._training_tasks(), poll_s)

    def stop(self) -> None:
        rpc.shutdown()

    def _training_tasks(self) -> list[str]:
        return [rpc.task_name(job, i) for job, i in self._tasks if job in ("chief", "worker")]


def _this_task(cluster: ClusterSpec, job_name: str | None, task_index: int | None) -> tuple[str, int]:
    """(job, index) of this task; ``ValueError`` when they are missing and the cluster does not decide them."""
    if job_name is None:
        if len(cluster.jobs) == 1 and cluster.num_tasks(cluster.jobs[0]) == 1:
            return cluster.jobs[0], 0
        raise ValueError(f"a cluster spec was given ({cluster.as_dict()}) but no job_name (task type): which task is this?")
    if task_index is None:
        if cluster.num_tasks(job_name) == 1:
            return job_name, cluster.task_indices(job_name)[0]
        raise ValueError(f"a cluster spec was given but no task_index (task id) for job {job_name!r}, "
                         f"which has {cluster.num_tasks(job_name)} tasks")
    cluster.task_address(job_name, task_index)  # ValueError for a task the cluster lacks
    return job_name, int(task_index)


# ---------- what a ps task holds ----------
class VariableStore:
    """A ps task's shards, the optimizer over them, and (on ps 0) the global step."""

    def __init__(self, index: int):
        self.index = index
        self.shards: dict[str, torch.Tensor] = {}
        self.trainable: dict[str, bool] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.groups: list[tuple[list[str], dict[str, Any]]] = []  # (variable names, options) per optimizer group
        self.layout: dict[str, tuple[str, int, tuple[int, ...]]] = {}  # key -> (variable, first row, whole shape)
        self.global_step = 0
        self.updates = 0  # optimizer steps applied here
        self.created = threading.Event()
        self.ready = threading.Event()
        self.finished = threading.Event()
        self.stop_signal = 0  # sync mode: a task that left stopped on this signal
        self._lock = threading.Lock()
        self._sync: SyncRound | None = None
        self._reports = StepReports()  # ps 0, sync mode: the tasks' metrics of logged steps
        self._left: set[str] = set()

    # ----- set-up -----
    def create(self, contents: Mapping[str, Any], sync_replicas: int | None = None) -> None:
        """Hold the shards of ``contents`` and build one optimizer over the trainable ones.

        ``contents`` (``parameter_server.contents_for``): ``shards`` (key -> value),
        ``trainable``, ``layout`` (key -> variable, first row, whole shape),
        ``optimizer_cls`` and ``groups``: per optimizer param group, (its variables'
        names, the keys of this ps's shards of them, its options), so that every shard
        keeps its variable's settings. ``sync_replicas``: sync mode, one gradient from
        each of that many training tasks makes a step.
        """
        trainable = contents["trainable"]
        with self._lock:
            self.shards = {k: v.detach().clone().requires_grad_(trainable[k]) for k, v in contents["shards"].items()}
            self.trainable, self.layout = dict(trainable), dict(contents["layout"])
            self.groups = [(names, dict(options)) for names, _, options in contents["groups"]]
            param_groups = [{"params": [self.shards[k] for k in keys], **options} for _, keys, options in contents["groups"]]
            param_groups = [g for g in param_groups if g["params"]]
            self.optimizer = contents["optimizer_cls"](param_groups) if param_groups else None
            self._sync = SyncRound(sync_replicas) if sync_replicas else None
        self.created.set()

    def open(self, global_step: int) -> None:
        with self._lock:
            self.global_step = global_step
        self.ready.set()

    # ----- serving -----
    def pull(self, keys: list[str]) -> list[torch.Tensor]:
        with self._lock:
            return [self.shards[k].detach().clone() for k in keys]

    def gather(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        with self._lock:
            return self.shards[key].detach().index_select(0, rows)

    def push(self, task: str, grads: dict[str, Any], increment: bool) -> Any:
        """Apply (async) or collect (sync) one task's gradients; the answer is (global step, finished, stop):
        ``stop``, in sync mode, the signal a task that left was stopped by (0: none), for the chief to stop on."""
        if self.finished.is_set():
            self._left.add(task)
            return (self.global_step, True, self.stop_signal)
        if self._sync is None:
            with self._lock:
                self._apply(grads, 1)
                self.global_step += int(increment)
                return (self.global_step, False, 0)
        return self._sync.add(self, grads, increment)

    def report(self, step: int, value: torch.Tensor, chief: bool) -> torch.futures.Future:
        """A training task's metrics of sync step ``step`` (just applied, when the chief reports): the chief's answer
        is every task's mean, once the tasks whose gradients made the step have all reported."""
        expected = (self._sync.last_count if self._sync is not None else 1) if chief else None
        return self._reports.add(self._lock, step, value, expected)

    def _apply(self, grads: dict[str, Any], count: int) -> None:
        """``optimizer.step()`` over the shards that got a gradient (the mean of ``count`` pushes)."""
        if self.optimizer is None or not grads:
            return
        for key, grad in grads.items():
            self.shards[key].grad = as_gradient(self.shards[key], grad, count, self.optimizer)
        self.optimizer.step()
        self.updates += 1
        for key in grads:
            self.shards[key].grad = None

    def leave(self, task: str, signum: int = 0) -> None:
        """``task`` trains no more: it ended, or stopped on signal ``signum``. A sync round no longer waits for its
        gradient, and a stopped task's signal goes to the chief in its push's answer: a sync job needs every
        task, so the chief stops too, after its save, rather than wait for a gradient that will not come."""
        if task in self._left:
            return
        self._left.add(task)
        if self._sync is not None and not self.finished.is_set():
            self.stop_signal = self.stop_signal or signum
            self._sync.leave(self)

    def finish(self) -> None:
        self.finished.set()
        if self._sync is not None:
            self._sync.release(self)

    def drain(self, tasks: list[str], poll_s: float, limit_s: float = 60.0) -> None:
        """After the chief finished: wait until every training task has left, or cannot be reached."""
        deadline = time.monotonic() + limit_s
        waiting = [t for t in tasks if t not in self._left]
        while waiting and time.monotonic() < deadline:
            waiting = [t for t in waiting if t not in self._left and _reachable(t)]
            time.sleep(poll_s)
        if waiting:
            log.warning("ps:%d: %s did not leave within %.0f s; stopping anyway", self.index, ", ".join(waiting), limit_s)

    def sum_of_squares(self) -> float:
        with self._lock:
            return sum(float(v.detach().double().pow(2).sum()) for k, v in self.shards.items() if self.trainable[k])

    @property
    def lock(self) -> threading.Lock:
        return self._lock


def _reachable(task: str) -> bool:
    try:
        trpc.rpc_sync(task, _ping, timeout=2)
        return True
    except Exception:  # noqa: BLE001 - gone
        return False


# ---------- the RPC functions (run on the ps task named in the call) ----------
_STORE: dict[str, VariableStore] = {}


def serve(index: int) -> VariableStore:
    """Make this process ps task ``index``: the RPC functions below act on the returned store."""
    if "store" not in _STORE:
        torch.sparse.check_sparse_tensor_invariants.disable()  # said explicitly: the optimizers' own sparse tensors stay quiet
        _STORE["store"] = VariableStore(index)
    return _STORE["store"]


def local_store() -> VariableStore:
    return _STORE["store"]


def _ping() -> bool:
    return True


def remote_create(contents: dict[str, Any], sync_replicas: int | None) -> None:
    local_store().create(contents, sync_replicas)


def remote_wait_created(timeout_s: float) -> None:
    store = local_store()
    if not store.created.wait(timeout_s):
        raise TimeoutError(f"ps:{store.index} did not build its variables within {timeout_s:.0f} s")


def remote_wait_ready(timeout_s: float) -> int:
    store = local_store()
    if not store.ready.wait(timeout_s):
        raise TimeoutError(f"ps:{store.index} was not given its variables within {timeout_s:.0f} s")
    return store.global_step


def remote_open(global_step: int) -> None:
    local_store().open(global_step)


def remote_pull(keys: list[str]) -> list[torch.Tensor]:
    return local_store().pull(keys)


def remote_gather(key: str, rows: torch.Tensor) -> torch.Tensor:
    return local_store().gather(key, rows)


@trpc.functions.async_execution
def remote_push(task: str, grads: dict[str, Any], increment: bool) -> torch.futures.Future:
    answer = local_store().push(task, grads, increment)
    if isinstance(answer, torch.futures.Future):
        return answer
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(answer)
    return done


@trpc.functions.async_execution
def remote_report(step: int, value: torch.Tensor, chief: bool) -> torch.futures.Future:
    return local_store().report(step, value, chief)


def remote_global_step() -> int:
    return local_store().global_step


def remote_leave(task: str, signum: int = 0) -> None:
    local_store().leave(task, signum)


def remote_finish() -> None:
    local_store().finish()


def remote_sum_of_squares() -> float:
    return local_store().sum_of_squares()


def remote_keys() -> list[str]:
    return sorted(local_store().shards)


def remote_save(path: str, progress: tuple[int, int, int]) -> None:
    shards.save(local_store(), Path(path), progress)


def remote_load(path: str) -> tuple[int, int, int]:
    store = local_store()
    if not store.created.is_set():  # its build would then overwrite what this loads: the resume would be lost
        raise RuntimeError(f"ps:{store.index} was asked to load {path} before it built its variables: the load "
                           "would be overwritten (a caller waits for them first)")
    return shards.load(store, Path(path))
