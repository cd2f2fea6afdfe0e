"""Can every node reach the address each other node's collectives advertise?

Before the process group is joined, one rank per node listens on a free port of
the address its collectives will advertise, and tries to connect to every other
node's. A node that no peer can reach (a firewall, an interface on another
network, a route that does not exist) is named before gloo's own connection
errors would bury it.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

CONNECT_TIMEOUT_S = 3.0


def probe(store: dist.Store, node: int, nodes: int, address: str | None, timeout_s: float) -> dict[int, dict[int, str]]:
    """This node's listener up while it tries the others'; {node: {peer: why it could not reach node}}."""
    listener = _listen(address)
    try:
        where = f"{address}:{listener.getsockname()[1]}" if listener else ""
        store.set(f"probe{node}", where)
        store.wait([f"probe{n}" for n in range(nodes)], timedelta(seconds=timeout_s))
        failed = {}
        for other in range(nodes):
            target = store.get(f"probe{other}").decode()
            why = _connect(target) if other != node and target else None
            if why:
                failed[other] = why
        store.set(f"reached{node}", json.dumps(failed))
        return unreachable(store, nodes, timeout_s)
    finally:
        if listener:
            listener.close()


def unreachable(store: dist.Store, nodes: int, timeout_s: float) -> dict[int, dict[int, str]]:
    """Every node's findings, by the node that could not be reached."""
    store.wait([f"reached{n}" for n in range(nodes)], timedelta(seconds=timeout_s))
    found: dict[int, dict[int, str]] = {}
    for peer in range(nodes):
        for target, why in json.loads(store.get(f"reached{peer}")).items():
            found.setdefault(int(target), {})[peer] = why
    return found


def _listen(address: str | None) -> socket.socket | None:
    if not address:
        return None
    try:
        return socket.create_server((address, 0), family=socket.AF_INET6 if ":" in address else socket.AF_INET)
    except OSError:
        return None  # the address is not this machine's: the peers' connections fail and say so


def _connect(target: str) -> str | None:
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def message(found: dict[int, dict[int, str]], present: dict[int, Any], master_addr: str) -> str:
    """One screen: each unreachable node, its address, who could not reach it, and the variable to set."""
    by_node = {info["node"]: info for info in present.values()}
    lines = ["the collectives of these nodes advertise an address their peers cannot reach:"]
    for node, peers in sorted(found.items()):
        info = by_node[node]
        tried = "; ".join(f"node {peer}: {why}" for peer, why in sorted(peers.items()))
        lines.append(f"  node {node} (host {info['host']}): {info['addr']}, {info['how']} ({tried}); set "
                     f"{info['variable']} on node {node} to the interface that reaches {master_addr} "
                     f"(`ip route get {master_addr}` names it)")
    return "\n".join(lines)
