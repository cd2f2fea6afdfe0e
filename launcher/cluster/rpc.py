"""torch.distributed.rpc (TensorPipe) for a chief / worker / ps cluster, listening only where the cluster says.

Every task of a parameter-server cluster is an RPC endpoint named ``TYPE:INDEX``
(``chief:0``, ``worker:1``, ``ps:0``); ranks follow the order chief, workers, ps.
The endpoints meet at a TCPStore on the chief's address. ``init_rpc``'s own
``tcp://`` rendezvous would listen on every interface, so dlaunch registers a
``dlaunch-rpc://`` rendezvous whose store is bound to the chief's host alone
(127.0.0.1 on one machine); TensorPipe's own listeners follow
``TP_SOCKET_IFNAME`` (loopback on one machine, set by ``cluster.env``).
"""

from __future__ import annotations

import datetime
import logging
import warnings
from typing import Any, Iterator, Sequence
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
import torch.distributed.rpc as rpc

from launcher.launch import rendezvous

log = logging.getLogger("dlaunch")
SCHEME = "dlaunch-rpc"
ROLES = ("chief", "worker", "ps")
_state: dict[str, Any] = {"store": None, "join_timeout_s": 120.0}


def task_name(task_type: str, index: int) -> str:
    return f"{task_type}:{index}"


def ordered(jobs: dict[str, Sequence[str]]) -> list[tuple[str, int]]:
    """Every task of ``jobs`` (role -> addresses) in rank order: chief, workers, ps."""
    unknown = [job for job in jobs if job not in ROLES]
    if unknown:
        raise ValueError(f"a parameter-server cluster has chief, worker and ps jobs; got {', '.join(map(repr, unknown))}")
    return [(role, i) for role in ROLES for i in range(len(jobs.get(role, [])))]


def _handler(url: str, timeout: datetime.timedelta | None = None, **_: Any) -> Iterator:
    """``dlaunch-rpc://host:port?rank=R&world_size=W``: rank 0 hosts the store on ``host`` only; the others connect."""
    parsed = urlparse(url)
    query = parse_qs(parsed.query)
    rank, world_size = int(query["rank"][0]), int(query["world_size"][0])
    timeout_s = _state["join_timeout_s"]
    host, port = parsed.hostname or "127.0.0.1", int(parsed.port or 0)
    if rank == 0:
        store = rendezvous.listening_store(host, port, timeout_s)
    else:
        try:
            store = rendezvous.client_store(host, port, timeout_s)
        except Exception as exc:  # noqa: BLE001 - reworded: here the chief is the one that hosts
            raise RuntimeError(f"the chief's RPC rendezvous at {host}:{port} did not open within {timeout_s:.0f} s; "
                               "is the chief task running, and reachable from this machine?") from exc
    _state["store"] = store
    yield store, rank, world_size


def _register() -> None:
    try:
        dist.register_rendezvous_handler(SCHEME, _handler)
    except RuntimeError:  # already registered in this process
        pass


def start(name: str, rank: int, world_size: int, host: str, port: int, rpc_timeout_s: float, join_timeout_s: float = 120.0) -> None:
    """This task's RPC endpoint; returns once every task of the cluster has started its own."""
    _register()
    _state["join_timeout_s"] = float(join_timeout_s)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"{SCHEME}://{_bracketed(host)}:{port}", rpc_timeout=float(rpc_timeout_s), num_worker_threads=32,
    )
    log.info("rpc: %s (rank %d of %d) joining at %s:%d", name, rank, world_size, host, port)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using a Backend")  # torch's own call inside init_rpc
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def store() -> dist.Store:
    """The store the endpoints met at (the chief's); ps tasks build their checkpoint process group on it."""
    if _state["store"] is None:
        raise RuntimeError("rpc.start() has not run in this process")
    return _state["store"]


def shutdown() -> None:
    """Leave without waiting for the others: a dead worker must not hold up the rest (graceful shutdown would)."""
    try:
        rpc.shutdown(graceful=False)
    except Exception:  # noqa: BLE001 - already down
        pass


def raised_remotely(exc: BaseException) -> bool:
    """Whether an RPC error is the callee's own exception (it ran the call), not a task that is gone."""
    text = " ".join(str(exc).split())
    return "On WorkerInfo" in text and "Traceback" in text


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
