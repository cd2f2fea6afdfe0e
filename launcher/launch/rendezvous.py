"""torch.distributed.elastic's c10d rendezvous, with stores that listen only where told.

A plain ``TCPStore`` server listens on every interface. dlaunch binds a socket
to the cluster's address (127.0.0.1 unless the cluster names other hosts) and
hands it to the store, so a loopback job is reachable from this machine only.
Node 0 hosts the rendezvous store; every other node connects to it. The
rendezvous protocol itself is torch's ``DynamicRendezvousHandler``, unchanged,
except that a node's group rank is the ``cluster.node_rank`` it was given (so
rank 0, and the run's results, are on node 0), and each node announces itself
so that a node that never comes can be named.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.api import (RendezvousConnectionError, RendezvousInfo, RendezvousStateError,
                                                      RendezvousStoreInfo)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

BACKEND = "dlaunch"
_listening: list[socket.socket] = []  # the stores serve on these sockets: keep them open
_handlers: list["_BoundRendezvousHandler"] = []  # this process's, to name missing nodes after a timeout


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` only (port 0: a free one), kept open for the process' lifetime."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=4096)
    _listening.append(sock)
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for another process to bind later; below the kernel's ephemeral range.

    The socket is closed again, so the port is only likely to stay free. A port the kernel hands out (to a
    port-0 bind, or to an outgoing connection: every gloo pair and store client makes some) can take it in
    the meantime; one below that range only another explicit pick can. Port 0's answer is the fallback.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    if low > _FIRST_PICKED + 1024:
        for port in random.SystemRandom().sample(range(_FIRST_PICKED, low), 32):  # not the seeded global random
            with socket.socket(family) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


_FIRST_PICKED = 10000  # below: registered services more often listen


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port the kernel hands out on its own (Linux; 0 where unknown, so nothing is below it)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def listening_store(host: str, port: int, timeout_s: float = 60.0, sock: socket.socket | None = None) -> TCPStore:
    """A TCPStore server listening on ``host:port`` only, or on an already bound ``sock``."""
    sock = sock or bind(host, port)
    return TCPStore(
        host,
        sock.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.fileno(),
        use_libuv=True,
    )


def client_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """A connection to node 0's store, waiting up to ``timeout_s`` for node 0 to open it."""
    _wait_for_listener(host, port, timeout_s)
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


def _wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Poll quietly (torch's own client retries log every attempt) until ``host:port`` accepts."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(2.0, timeout_s)).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RendezvousConnectionError(
                    f"node 0 did not open the rendezvous at {host}:{port} within {timeout_s:g} s: missing node 0 "
                    f"(it hosts the rendezvous; start it with cluster.node_rank=0, and check that {host}:{port} "
                    f"is reachable from this machine)"
                ) from None
            time.sleep(0.2)


class _Backend(C10dRendezvousBackend):
    @property
    def name(self) -> str:
        return BACKEND


class _BoundRendezvousHandler(DynamicRendezvousHandler):
    """Group rank = the configured node rank; the workers' store is bound like the rendezvous'."""

    bind_host = "127.0.0.1"
    node_rank: int | None = None
    nodes: PrefixStore | None = None
    claim: str | None = None  # what this node wrote under its node rank
    failed_node: int | None = None  # a node whose workers failed for good (announce_failure)

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
        return listening_store(self.bind_host, master_port)

    def _get_world(self) -> tuple[int, int]:
        rank, world_size = super()._get_world()
        return (rank if self.node_rank is None else self.node_rank), world_size

    def next_rendezvous(self) -> RendezvousInfo:
        info = super().next_rendezvous()
        if self.node_rank is not None and info.world_size != self._settings.max_nodes:
            raise RendezvousStateError(f"{info.world_size} nodes met, but the cluster has {self._settings.max_nodes}")
        self._publish_bootstrap(info)
        return info

    def _publish_bootstrap(self, info: RendezvousInfo) -> None:
        """Node 0 writes where its workers' store listens under every round's keys, not the first round's alone.

        torch's handler writes it once, in round 0, and every later round reuses what each process found then; a
        node that was killed and started again (a new process, in round 1 or later) waits for that key in its own
        round and never gets it, and node 0 waits for that node: both hung until the rendezvous timed out.
        """
        found = getattr(self, "_bootstrap_store_info", None)
        if info.rank != 0 or found is None or not getattr(self, "use_agent_store", False):
            return
        info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, found.master_addr.encode())
        info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(found.master_port).encode())


def round_of(handler: Any, fallback: int) -> int:
    """The rendezvous round ``handler`` last joined (the same on every node); ``fallback`` for a handler of no rounds."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    return int(getattr(state, "round", fallback))


def announce(nodes: PrefixStore, node_rank: int, who: str) -> None:
    """Claim ``node_rank``; two machines started with the same node rank fail here, by name. A claim left by a
    node that is gone (it released it on its way out, or it ran here and its process has ended) is taken over:
    a node stopped while the others waited joins again with the same command."""
    key = f"node{node_rank}"
    holder = nodes.compare_set(key, "", who).decode()
    if holder != who and _gone(holder, who):
        holder = nodes.compare_set(key, holder, who).decode()
    if holder != who:
        raise RendezvousStateError(
            f"cluster.node_rank={node_rank} is already taken by {holder}; give each node its own node_rank"
        )


def same_node_count(nodes: PrefixStore, node_rank: int, count: int, who: str) -> None:
    """Every node must be started for the same cluster: a node that counts other nodes than the rest waits for
    nodes that never come, or meets too few, until the rendezvous times out. Said at once by the node that comes
    second, against each node here now that counts otherwise (a node gone may have said something else)."""
    nodes.set(f"count{node_rank}", str(count))
    joined = joined_nodes(nodes, count)
    for rank, holder in sorted(joined.items()):
        theirs = nodes.get(f"count{rank}").decode() if rank != node_rank and nodes.check([f"count{rank}"]) else None
        if theirs is not None and theirs != str(count) and not _gone(holder, who):
            raise RendezvousStateError(
                f"node {rank} was started with a cluster of {theirs} nodes, this node (node {node_rank}) with {count}: "
                "every node must run the same command, but for cluster.node_rank")


def release_claims() -> None:
    """This process's node-rank claims, given back as it ends (node 0's store may be gone already)."""
    for handler in _handlers:
        if handler.nodes is not None and handler.claim is not None:
            try:
                handler.nodes.compare_set(f"node{handler.node_rank}", handler.claim, "")
            except Exception:  # noqa: BLE001 - nothing to give back to
                pass


def leave_unfinished() -> None:
    """This node stops before its rendezvous completed: out of the participants now (torch's own exit step), not
    when its missed keep-alives expire, so that the nodes that meet next do not count a node that is gone."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    for handler in _handlers:
        try:
            handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + 5)
        except Exception:  # noqa: BLE001 - node 0's store is gone, or the exit timed out: the keep-alives will tell
            pass


def claim_of_this_process(host: str) -> str:
    """``HOST (pid N, pidns M)``: the pid namespace tells containers that share a host name apart."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{host} (pid {os.getpid()}, pidns {namespace})"


def _gone(holder: str, who: str) -> bool:
    """``holder`` released its claim, or ran on this host, in this pid namespace, and its process has ended."""
    if not holder:
        return True
    theirs, mine = (re.fullmatch(r"(.*) \(pid (\d+), pidns (\d+)\)", text) for text in (holder, who))
    if theirs is None or mine is None or (theirs.group(1), theirs.group(3)) != (mine.group(1), mine.group(3)):
        return False
    try:
        os.kill(int(theirs.group(2)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def joined_nodes(nodes: Store, count: int) -> dict[int, str]:
    """Which node ranks announced themselves, and from where."""
    claims = {r: nodes.get(f"node{r}").decode() for r in range(count) if nodes.check([f"node{r}"])}
    return {r: who for r, who in claims.items() if who}  # "": a node that left gave its claim back


def _last_handler() -> "_BoundRendezvousHandler | None":
    """This process's last rendezvous that reached the store with a node rank."""
    return next((h for h in reversed(_handlers) if h.nodes is not None), None)


def last_joined() -> dict[int, str] | None:
    """The nodes seen by this process's last rendezvous (None if it never reached the store), but for those whose
    process is known to be gone (killed on this host: their claim outlives them)."""
    handler = _last_handler()
    try:
        joined = joined_nodes(handler.nodes, handler._settings.max_nodes) if handler else None
    except Exception:  # noqa: BLE001 - the store may be gone with node 0
        return None
    if joined is None:
        return None
    return {r: who for r, who in joined.items() if handler.claim is None or not _gone(who, handler.claim)}


def other_counts() -> dict[int, int]:
    """The nodes that came to this process's last rendezvous counting another number of nodes than it does."""
    handler = _last_handler()
    if handler is None:
        return {}
    count = handler._settings.max_nodes
    try:
        said = {r: int(handler.nodes.get(f"count{r}").decode()) for r in range(count) if handler.nodes.check([f"count{r}"])}
    except Exception:  # noqa: BLE001 - the store may be gone with node 0
        return {}
    return {r: n for r, n in said.items() if n != count}


def _seconds(params: RendezvousParameters, key: str, default: int) -> timedelta:
    return timedelta(seconds=params.get_as_int(key, default))


def _store(params: RendezvousParameters, host: str, port: int) -> Store:
    join = params.get_as_int("join_timeout", 600)
    if not params.get_as_bool("is_host", True):
        return client_store(host, port, join)
    fd = params.get_as_int("listen_fd")
    sock = socket.socket(fileno=os.dup(fd)) if fd is not None else None
    if sock is not None:
        _listening.append(sock)
    return listening_store(host, port, max(join, params.get_as_int("read_timeout", 60)), sock)


def _create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    store = _store(params, host, port)
    timeout = RendezvousTimeout(
        join=_seconds(params, "join_timeout", 600),
        last_call=_seconds(params, "last_call_timeout", 30),
        close=_seconds(params, "close_timeout", 30),
    )
    handler = _BoundRendezvousHandler.from_backend(
        params.run_id, store, _Backend(store, params.run_id),
        params.min_nodes, params.max_nodes, params.local_addr, timeout,
    )
    handler.bind_host = host if params.get_as_bool("is_host", True) else (params.local_addr or host)
    handler.node_rank = params.get_as_int("node_rank")
    _handlers.append(handler)  # first: a claim made below is given back (release_claims) however this ends
    if handler.node_rank is not None:
        handler.nodes = PrefixStore(f"dlaunch/{params.run_id}/nodes", store)
        handler.claim = claim_of_this_process(params.local_addr or socket.getfqdn())
        announce(handler.nodes, handler.node_rank, handler.claim)
        same_node_count(handler.nodes, handler.node_rank, params.max_nodes, handler.claim)
    return handler


_registered = False


def register() -> str:
    """Register the ``dlaunch`` rendezvous backend once; return its name."""
    global _registered
    if not _registered:
        rendezvous_handler_registry.register(BACKEND, _create_handler)
        _registered = True
    return BACKEND


# ---------- a multi-node job's end after a failure, in order ----------
# Node 0's agent hosts the store that every agent and worker talks to. A node whose workers failed for good says so
# there; the others stop their workers (teardown), and node 0 keeps the store up until they have left: a node that
# found the store gone under its workers printed torch's C++ traces and "could not meet", and named none of its ranks.
def announce_failure(handler: Any, node_rank: int) -> None:
    """This node's workers failed and will not restart: the other nodes stop theirs."""
    if getattr(handler, "nodes", None) is None:
        return
    handler.failed_node = node_rank
    with contextlib.suppress(Exception):  # the store is gone already: the others find that out themselves
        handler.nodes.compare_set("failed", "", str(node_rank))


def failed_peer(handler: Any) -> int | None:
    """The node whose workers failed for good (this one's did not), or None."""
    if getattr(handler, "nodes", None) is None:
        return None
    try:
        if not handler.nodes.check(["failed"]):
            return None
        handler.failed_node = int(handler.nodes.get("failed").decode())
    except SignalException:  # a stop signal during the store's answer (torch's handler raises it): the agent's, not ours
        raise
    except Exception:  # noqa: BLE001 - node 0's store is gone: torch's own check says so next
        return None
    return handler.failed_node


def leave_after_failure(grace_s: float) -> None:
    """Once a node failed: node 0 waits (up to ``grace_s``) for the other nodes to leave before its store goes;
    the others say they left, as the last thing they ask of the store."""
    for handler in _handlers:
        if handler.nodes is None or getattr(handler, "failed_node", None) is None:
            continue
        with contextlib.suppress(Exception):  # a store gone, or a node that never says it left
            if handler.node_rank:
                handler.nodes.add("left", 1)
                continue
            deadline = time.monotonic() + grace_s
            while handler.nodes.add("left", 0) < handler._settings.max_nodes - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
