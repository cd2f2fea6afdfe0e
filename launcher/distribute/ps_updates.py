"""How a ps task applies pushed gradients: sync rounds (``SyncReplicasOptimizer``'s accumulator), and sparse rows;
and, on ps 0, the training tasks' metrics of a sync step (``StepReports``).

``SyncRound`` works on the ps task's ``VariableStore`` (``server.py``): its lock, ``_apply``, global step and
``stop_signal``.
"""

from __future__ import annotations

from typing import Any

import torch


class SyncRound:
    """``SyncReplicasOptimizer``'s accumulator: a step is applied once every training task has pushed."""

    def __init__(self, replicas: int):
        self.replicas = replicas
        self.grads: dict[str, list[Any]] = {}
        self.waiting: list[torch.futures.Future] = []
        self.increment = False
        self.last_count = 0  # the training tasks whose gradients made the last applied step

    def add(self, store: Any, grads: dict[str, Any], increment: bool) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        with store.lock:
            for key, grad in grads.items():
                self.grads.setdefault(key, []).append(grad)
            self.increment |= increment
            self.waiting.append(future)
            if len(self.waiting) >= self.replicas:
                self._apply(store)
        return future

    def leave(self, store: Any) -> None:
        """One training task fewer: this round and the next average the gradients of the tasks still training."""
        with store.lock:
            self.replicas = max(1, self.replicas - 1)
            if self.waiting and len(self.waiting) >= self.replicas:
                self._apply(store)

    def _apply(self, store: Any) -> None:
        self.last_count = len(self.waiting)
        store._apply({k: _sum(v) for k, v in self.grads.items()}, len(self.waiting))
        store.global_step += int(self.increment)
        self._resolve((store.global_step, False, store.stop_signal))

    def release(self, store: Any) -> None:
        with store.lock:
            self._resolve((store.global_step, True, store.stop_signal))

    def _resolve(self, answer: Any) -> None:
        waiting, self.waiting, self.grads, self.increment = self.waiting, [], {}, False
        for future in waiting:
            future.set_result(answer)


class StepReports:
    """On ps 0, in sync mode: every training task's metrics of a logged step, so that the chief logs the global batch's.

    Each task that pushed a step's gradients sends its metrics of that step (at logged steps only: the loop reads
    them nowhere else); the chief's report is answered once all of theirs are in, with their mean. The tasks' shares
    of a global batch are equal (the batch divides, whole batches only), so that is the global batch's mean, what
    one device logs. A worker's report is answered at once.
    """

    def __init__(self) -> None:
        self.values: dict[int, list[torch.Tensor]] = {}  # step -> the metrics reported so far
        self.chief: dict[int, tuple[int, torch.futures.Future]] = {}  # step -> (tasks that made it, the chief's answer)

    def add(self, lock: Any, step: int, value: torch.Tensor, expected: int | None) -> torch.futures.Future:
        """``expected``: the chief's report, with the number of tasks whose gradients made ``step``; None: a worker's."""
        mine: torch.futures.Future = torch.futures.Future()
        with lock:
            self.values.setdefault(step, []).append(value)
            if expected is not None:
                self.chief[step] = (expected, mine)
            count, answer = self.chief.get(step, (0, None))
            done = answer is not None and len(self.values[step]) >= count
            if done:
                del self.chief[step]
                got = self.values.pop(step)
        if answer is not mine:  # a worker's report: answered at once
            mine.set_result(None)
        if done:
            answer.set_result(torch.stack(got).mean(dim=0))
        return mine


def _sum(grads: list[Any]) -> Any:
    if isinstance(grads[0], tuple):  # sparse rows: (row indices, values)
        return torch.cat([r for r, _ in grads]), torch.cat([v for _, v in grads])
    total = grads[0].clone()
    for g in grads[1:]:
        total += g
    return total


SPARSE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


def as_gradient(shard: torch.Tensor, grad: Any, count: int, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """A pushed gradient as the shard's ``.grad``: sparse rows stay sparse where the optimizer keeps dense state."""
    if not isinstance(grad, tuple):
        return grad / count if count > 1 else grad
    rows, values = grad
    values = values / count if count > 1 else values
    sparse = torch.sparse_coo_tensor(rows.unsqueeze(0), values, shard.shape, check_invariants=False).coalesce()
    if _sparse_ok(optimizer, shard):
        return sparse
    return sparse.to_dense()


def _sparse_ok(optimizer: torch.optim.Optimizer, shard: torch.Tensor) -> bool:
    """Sparse gradients only where the optimizer's state stays dense and its update is the dense one's."""
    if not isinstance(optimizer, SPARSE_OPTIMIZERS):
        return False
    group = next(g for g in optimizer.param_groups if any(p is shard for p in g["params"]))
    if isinstance(optimizer, torch.optim.SGD):
        return not group.get("momentum") and not group.get("weight_decay")
    return not group.get("weight_decay")
