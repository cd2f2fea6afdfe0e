"""``ClusterCoordinator``: TF2's way to drive a parameter-server cluster, over torch.distributed.rpc.

The chief (the coordinator) schedules functions; idle workers run them and send
the results back. A worker that dies has its functions run again on the others,
as TF's fault-tolerance guide describes. Workers only serve::

    # on each worker: serve until the chief releases the cluster
    Server(cluster, "worker", i).join()

    # on the chief
    strategy = ParameterServerStrategy(resolver)
    coordinator = ClusterCoordinator(strategy)
    per_worker_iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    results = [coordinator.schedule(step_fn, args=(per_worker_iterator,)) for _ in range(10)]
    coordinator.join()
    coordinator.fetch(results)            # [value, ...]
    coordinator.shutdown()                # dlaunch's addition: TF's workers serve until killed

Functions and their arguments travel by pickle: define them at module level. An
argument from ``create_per_worker_dataset`` (or any ``PerWorkerValues``) becomes
the running worker's own value.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

import torch.distributed.rpc as trpc

from launcher.cluster import rpc
from launcher.distribute.values import map_structure

log = logging.getLogger("dlaunch")


class RemoteValue:
    """The future result of a scheduled function: ``fetch()`` waits for it (and raises its error)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def fetch(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    get = fetch

    def __repr__(self) -> str:
        return f"RemoteValue({'done' if self._done.is_set() else 'pending'})"


class PerWorkerValues:
    """One value per worker (``values[i]`` belongs to ``worker:i``); a function gets its worker's."""

    def __init__(self, values: list[Any]):
        self._values = list(values)

    def __repr__(self) -> str:
        return f"PerWorkerValues({len(self._values)} workers)"


class PerWorkerDataset:
    """``dataset_fn()``'s dataset, built on every worker; ``iter()`` gives one iterator per worker."""

    def __init__(self, coordinator: "ClusterCoordinator", dataset_fn: Callable[[], Any]):
        self._coordinator = coordinator
        self._datasets = [trpc.remote(w, _call, args=(dataset_fn,)) for w in coordinator.workers]

    def __iter__(self) -> "PerWorkerIterator":
        return PerWorkerIterator([trpc.remote(w, _make_iterator, args=(d,)) for w, d in zip(self._coordinator.workers, self._datasets)])


class PerWorkerIterator(PerWorkerValues):
    """One iterator per worker, each on its worker: pass it to ``schedule``; ``next()`` runs there."""

    def __iter__(self) -> "PerWorkerIterator":
        return self

    def __next__(self) -> Any:
        raise TypeError("a per-worker iterator is read on the workers: pass it to coordinator.schedule(fn, args=(it,)) "
                        "and call next() inside fn")


class _Closure:
    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs, self.result = fn, args, kwargs, RemoteValue()

    def for_worker(self, index: int) -> tuple[tuple, dict]:
        pick = lambda v: v._values[index] if isinstance(v, PerWorkerValues) else v  # noqa: E731
        return map_structure(pick, self.args), map_structure(pick, self.kwargs)


class ClusterCoordinator:
    """Schedule functions on the workers of ``strategy``'s cluster (a ``ParameterServerStrategy`` on the chief).

    Args:
        strategy: the chief's ``ParameterServerStrategy``; its cluster's workers run the functions.
        rpc_timeout_s: how long one function may run on a worker.
    """

    def __init__(self, strategy: Any, rpc_timeout_s: float = 600.0):
        cluster = strategy.cluster_resolver.cluster_spec()
        self.strategy = strategy
        self.workers = [rpc.task_name("worker", i) for i in cluster.task_indices("worker")] if "worker" in cluster.jobs else []
        if not self.workers:
            raise ValueError(f"the cluster {cluster.as_dict()} has no workers to schedule functions on")
        self._timeout_s = rpc_timeout_s
        self._queue: queue.Queue[_Closure | None] = queue.Queue()
        self._lock = threading.Condition()
        self._pending = 0
        self._alive = set(range(len(self.workers)))
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True, name=f"coordinator-{w}")
                         for i, w in enumerate(self.workers)]
        for t in self._threads:
            t.start()

    def schedule(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> RemoteValue:
        """Run ``fn(*args, **kwargs)`` on some idle worker; returns its ``RemoteValue`` at once.

        An error of an earlier function is raised here (as TF does), and then cleared.
        """
        self._raise_error()
        closure = _Closure(fn, tuple(args), dict(kwargs or {}))
        with self._lock:
            self._pending += 1
        self._queue.put(closure)
        return closure.result

    def join(self) -> None:
        """Wait until every scheduled function has run; raise the first error among them."""
        with self._lock:
            self._lock.wait_for(lambda: self._pending == 0 or not self._alive)
            if self._pending and not self._alive:
                raise RuntimeError(f"every worker of {self.workers} is gone; {self._pending} function(s) did not run")
        self._raise_error()

    def done(self) -> bool:
        """Whether every scheduled function has run."""
        with self._lock:
            return self._pending == 0

    def fetch(self, val: Any) -> Any:
        """The values of ``RemoteValue`` leaves of ``val`` (waiting for them); other leaves as they are."""
        return map_structure(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, val)

    def create_per_worker_dataset(self, dataset_fn: Callable[[], Any]) -> PerWorkerDataset:
        """``dataset_fn()`` called on every worker; pass ``iter(result)`` to scheduled functions."""
        return PerWorkerDataset(self, dataset_fn)

    def shutdown(self) -> None:
        """Release the workers (their ``Server.join()`` returns); dlaunch's addition to TF's API."""
        for _ in self._threads:
            self._queue.put(None)
        for i in sorted(self._alive):
            try:
                trpc.rpc_sync(self.workers[i], _release, timeout=10)
            except RuntimeError as exc:
                log.warning("coordinator: %s did not take its release: %s", self.workers[i], exc)

    def _serve(self, index: int) -> None:
        """One worker's dispatcher: take a function, run it there; if the worker is gone, put it back and stop."""
        while True:
            closure = self._queue.get()
            if closure is None:
                return
            args, kwargs = closure.for_worker(index)
            try:
                value = trpc.rpc_sync(self.workers[index], _call, args=(closure.fn, *args), kwargs=kwargs, timeout=self._timeout_s)
            except Exception as exc:  # noqa: BLE001 - sorted below: the function's error, or the worker's death
                if not rpc.raised_remotely(exc):
                    self._worker_gone(index, closure, exc)
                    return
                self._finish(closure, error=exc)
                continue
            self._finish(closure, value=value)

    def _finish(self, closure: _Closure, value: Any = None, error: BaseException | None = None) -> None:
        closure.result._set(value, error)
        with self._lock:
            self._pending -= 1
            if error is not None and self._error is None:
                self._error = error
            self._lock.notify_all()

    def _worker_gone(self, index: int, closure: _Closure, exc: BaseException) -> None:
        log.warning("coordinator: %s is gone (%s); its function runs again on another worker",
                    self.workers[index], " ".join(str(exc).split())[:160])
        with self._lock:
            self._alive.discard(index)
            self._lock.notify_all()
        self._queue.put(closure)  # rescheduled: an idle worker takes it

    def _raise_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error


# ---------- run on the workers ----------
_RELEASED = threading.Event()


def _local(value: Any) -> Any:
    """A worker's own value: an RRef it owns (its per-worker iterator) is read here."""
    # Unpickled RRefs are the base class, PyRRef.
    return value.local_value() if isinstance(value, trpc.PyRRef) and value.is_owner() else value


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*map_structure(_local, list(args)), **map_structure(_local, kwargs))


def _make_iterator(dataset: Any) -> Any:
    return iter(_local(dataset))


def _release() -> None:
    _RELEASED.set()


def wait_for_release() -> None:
    """On a worker: block until the coordinator releases the cluster."""
    _RELEASED.wait()
