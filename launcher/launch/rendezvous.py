"""torch.distributed.elastic's c10d rendezvous, with stores that listen only where told.

A plain ``TCPStore`` server listens on every interface. dlaunch binds a socket
to the cluster's address (127.0.0.1 for one node) and hands it to the store, so
a single-node job is reachable from this machine only. The rendezvous protocol
itself is torch's ``DynamicRendezvousHandler``, unchanged.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

BACKEND = "dlaunch"
_listening: list[socket.socket] = []  # the stores serve on these sockets: keep them open


def listening_store(host: str, port: int, timeout_s: float = 60.0) -> TCPStore:
    """A TCPStore server listening on ``host:port`` only (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=4096)
    _listening.append(sock)
    return TCPStore(
        host,
        sock.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.fileno(),
        use_libuv=True,
    )


class _Backend(C10dRendezvousBackend):
    @property
    def name(self) -> str:
        return BACKEND


class _BoundRendezvousHandler(DynamicRendezvousHandler):
    """Shares its store with the workers through a server bound like the rendezvous'."""

    bind_host = "127.0.0.1"

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
        return listening_store(self.bind_host, master_port)


def _seconds(params: RendezvousParameters, key: str, default: int) -> timedelta:
    return timedelta(seconds=params.get_as_int(key, default))


def _create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    store = listening_store(host, port, params.get_as_int("read_timeout", 60))
    timeout = RendezvousTimeout(
        join=_seconds(params, "join_timeout", 600),
        last_call=_seconds(params, "last_call_timeout", 30),
        close=_seconds(params, "close_timeout", 30),
    )
    handler = _BoundRendezvousHandler.from_backend(
        params.run_id, store, _Backend(store, params.run_id),
        params.min_nodes, params.max_nodes, params.local_addr, timeout,
    )
    handler.bind_host = host
    return handler


_registered = False


def register() -> str:
    """Register the ``dlaunch`` rendezvous backend once; return its name."""
    global _registered
    if not _registered:
        rendezvous_handler_registry.register(BACKEND, _create_handler)
        _registered = True
    return BACKEND
