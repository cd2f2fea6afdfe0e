"""A training task's RPCs to the ps tasks: pull values (whole, or embedding rows), push gradients.

Transport is torch.distributed.rpc; a ps that stops answering is named in a
``ParameterServerUnavailable`` error rather than left as TensorPipe's text::

    client = Client("worker:0", num_ps=2, placement=placement, timeout_s=60)
    values = client.pull(["fc.weight"])                # whole, its shards joined along dim 0
    client.push(gradients, increment=True)              # answers the global step
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
import torch.distributed.rpc as trpc

from launcher.cluster import rpc
from launcher.distribute import server as ps_server
from launcher.distribute.ps_placement import Placement


class ParameterServerUnavailable(RuntimeError):
    """A ps task stopped answering: its variables are gone until the job restarts from a checkpoint."""

    explained = True  # the message says it all: no traceback


class Client:
    """RPCs from one training task to the ps tasks, with a dead ps named in the error."""

    def __init__(self, task: str, num_ps: int, placement: Placement, timeout_s: float):
        self.task, self.num_ps, self.placement, self.timeout_s = task, num_ps, placement, timeout_s
        self.global_step, self.finished = 0, False
        self.stop_signal = 0  # sync mode: the signal another task stopped on (the chief stops on it too)
        self.sync, self.sync_timeout_s = False, 300.0  # sync mode: a push waits up to this for the step's other gradients

    def call(self, ps: int, fn: Any, *args: Any) -> Any:
        return self.wait(ps, trpc.rpc_async(f"ps:{ps}", fn, args=args, timeout=self.timeout_s))

    def wait(self, ps: int, future: Any) -> Any:
        try:
            return future.wait()
        except RuntimeError as exc:
            raise _unavailable(ps, exc) from None

    def each(self, fn: Any, *args: Any, waits_s: float = 0.0) -> list[Any]:
        """``fn(*args)`` on every ps; ``waits_s``: how long ``fn`` itself may wait there (for the variables, for the
        chief's word), which the RPC's timeout adds to ``rpc_timeout_s``."""
        futures = [trpc.rpc_async(f"ps:{k}", fn, args=args, timeout=self.timeout_s + waits_s) for k in range(self.num_ps)]
        return [self.wait(k, f) for k, f in enumerate(futures)]

    def pull(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Whole values of ``names`` (their shards concatenated along dim 0)."""
        shards = [s for n in names for s in self.placement.of(n)]
        keys = {k: [s.key for s in shards if s.ps == k] for k in range(self.num_ps)}
        futures = {k: trpc.rpc_async(f"ps:{k}", ps_server.remote_pull, args=(v,), timeout=self.timeout_s) for k, v in keys.items() if v}
        got = {}
        for k, future in futures.items():
            got.update(zip(keys[k], self.wait(k, future)))
        return {n: _join([got[s.key] for s in self.placement.of(n)]) for n in names}

    def gather(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of variable ``name``, from the shards that hold them."""
        shards = self.placement.of(name)
        out = torch.empty((ids.numel(), *shards[0].full_shape[1:]), dtype=shards[0].dtype)
        pending = []
        for s in shards:
            mask = (ids >= s.offset) & (ids < s.offset + s.shape[0])
            if bool(mask.any()):
                future = trpc.rpc_async(f"ps:{s.ps}", ps_server.remote_gather, args=(s.key, ids[mask] - s.offset), timeout=self.timeout_s)
                pending.append((s.ps, mask, future))
        for ps, mask, future in pending:
            out[mask] = self.wait(ps, future)
        return out

    def push(self, grads: dict[int, dict[str, Any]], increment: bool) -> None:
        """Every ps gets this task's gradients for its shards (possibly none: sync counts every task)."""
        timeout = self.sync_timeout_s if self.sync else self.timeout_s  # a sync push waits for the slowest task's step
        futures = {k: trpc.rpc_async(f"ps:{k}", ps_server.remote_push, args=(self.task, grads.get(k, {}), increment and k == 0),
                                     timeout=timeout)
                   for k in range(self.num_ps)}
        for k, future in futures.items():
            step, finished, stop = self.wait(k, future)
            if k == 0:
                self.global_step = step
            self.finished |= finished
            self.stop_signal = self.stop_signal or stop


def _unavailable(ps: int, exc: BaseException) -> BaseException:
    if rpc.raised_remotely(exc):  # the ps ran the call and raised: its own error
        return exc
    text = re.sub(r"\s*\(this error originated at [^)]*\)", "", " ".join(str(exc).split()))
    return ParameterServerUnavailable(f"parameter server ps:{ps} unavailable ({text[:200]})")


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
