"""Values exchanged between the training tasks of a parameter-server cluster, through ps 0.

The chief and the workers share variables on the ps tasks but no process group,
so ``strategy.reduce`` meets there: every task sends its part of round ``n`` to
ps 0 (torch.distributed.rpc), and each gets every task's part once all have
arrived. The wait is a future on ps 0, not a blocked RPC thread::

    parts = exchange(round_id=3, position=1, value=torch.tensor([4., 5.]), count=2, timeout_s=60)
    # [chief's part, worker 0's part]
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed.rpc as trpc

_LOCK = threading.Lock()
_ROUNDS: dict[int, tuple[dict[int, Any], list[torch.futures.Future]]] = {}


@trpc.functions.async_execution
def remote_exchange(round_id: int, position: int, value: Any, count: int) -> torch.futures.Future:
    """On ps 0: hold ``value`` for round ``round_id``; answer every caller with all ``count`` parts, in position order."""
    future: torch.futures.Future = torch.futures.Future()
    with _LOCK:
        values, waiting = _ROUNDS.setdefault(round_id, ({}, []))
        values[position] = value
        waiting.append(future)
        if len(values) < count:
            return future
        del _ROUNDS[round_id]
    ordered = [values[i] for i in range(count)]
    for f in waiting:
        f.set_result(ordered)
    return future


def exchange(round_id: int, position: int, value: Any, count: int, timeout_s: float) -> list[Any]:
    """Every training task's ``value`` for this round (this task is ``position`` of ``count``)."""
    future = trpc.rpc_async("ps:0", remote_exchange, args=(round_id, position, value, count), timeout=timeout_s)
    try:
        return future.wait()
    except RuntimeError as exc:
        raise RuntimeError(
            f"strategy.reduce waits for all {count} training tasks, and some did not reach reduce #{round_id} within "
            f"{timeout_s:.0f} s (a task that finished, left or died cannot take part): {' '.join(str(exc).split())[:200]}"
        ) from None
