"""Host names, ``host:port`` addresses and task lists, checked before anything listens or connects.

``cluster.master_addr`` is both where node 0's rendezvous store listens and where
every other node connects, so it must be one concrete address: an IPv4 or IPv6
literal, or a host name. A wildcard (``0.0.0.0``, ``::``) would listen on every
interface and names no machine to connect to.

    >>> host_problem("10.0.0.1") is None, host_problem("node-0.cluster") is None
    (True, True)
    >>> host_problem("10.0.0.1:29500")
    "has a ':' but is not an IPv6 address; give the port as cluster.master_port"
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Any

ALLOWED = "an IPv4 or IPv6 address (10.0.0.1, ::1) or a host name (node-0.cluster)"
# RFC 1123 labels; '_' too, as container runtimes name hosts with it.
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


def host_problem(host: str) -> str | None:
    """Why ``host`` is not an IP literal or a host name; None when it is one."""
    if not host or host != host.strip():
        return "is empty or has spaces around it"
    if host.startswith("["):
        return "has brackets; write an IPv6 address without them (::1)"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return _name_problem(host)
    if ip.is_unspecified:
        return ("is the wildcard address: it would listen on every interface and names no machine to connect to; "
                "give node 0's address on the network the nodes share (127.0.0.1 on one machine)")
    return None


def _name_problem(host: str) -> str | None:
    if "://" in host or "/" in host:
        return "is a URL or a path; give the host alone (10.0.0.1 or node-0)"
    if ":" in host:
        return "has a ':' but is not an IPv6 address; give the port as cluster.master_port"
    if re.fullmatch(r"[0-9.]+", host):
        return "is not a valid IPv4 address (four numbers 0-255)"
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253:
        return f"is {len(name)} characters long; a host name has at most 253"
    bad = next((label for label in name.split(".") if not _LABEL.match(label)), None)
    if bad is not None:
        shown = repr(bad) if bad else "an empty label"
        return f"is not a host name: {shown} is not 1-63 letters, digits, '-' or '_' (not starting or ending with '-')"
    return None


def is_loopback(host: str) -> bool:
    """``localhost`` (any case, a trailing dot allowed), 127.0.0.0/8 or ::1: reachable from this machine only."""
    if host.lower().rstrip(".") in ("localhost", "ip6-localhost", "ip6-loopback"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def not_here(host: str) -> str | None:
    """Why ``host`` is no address of this machine (it does not resolve, or nothing here can listen on it); None
    when a socket binds to it (on a free port, closed at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as the rendezvous binds it (launch/rendezvous.py)
    try:
        _, kind, proto, _, where = socket.getaddrinfo(host, 0, family=family, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        return f"does not resolve ({getattr(exc, 'strerror', None) or exc})"
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.bind(where)
    except OSError as exc:
        return f"is not an address of this machine ({where[0]}: {exc.strerror or exc})"
    return None


def split_address(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as ``(host, port)``; ``ValueError`` says what is wrong."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not port.isdigit():
        raise ValueError(f"{text!r} is not host:port (e.g. 10.0.0.1:29500, [::1]:29500)")
    if not 0 < int(port) <= 65535:
        raise ValueError(f"{text!r}: port {port} is not in 1..65535")
    problem = host_problem(host)
    if problem:
        raise ValueError(f"{text!r}: the host {host!r} {problem}")
    return host, int(port)


# ---------- a cluster as a TF_CONFIG-style task list ----------
class TaskListError(ValueError):
    """``cluster.tasks`` or ``cluster.task`` is wrong; ``key`` names which."""

    def __init__(self, key: str, value: Any, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.value, self.message = key, value, message


def ordered_tasks(tasks: dict[str, list[str]]) -> list[str]:
    return [*tasks.get("chief", []), *tasks.get("worker", [])]


def _task_lists(tasks: Any) -> dict[str, list[str]] | None:
    """``tasks`` when it has the shape of a task list (None: pydantic names what is wrong)."""
    if not isinstance(tasks, dict):
        return None
    unknown = [role for role in tasks if role not in ("chief", "worker", "ps")]
    if unknown:
        raise TaskListError("cluster.tasks", tasks, f"unknown role {unknown[0]!r}; a task list has chief, worker and ps")
    lists = {role: v or [] for role, v in tasks.items()}
    if not all(isinstance(v, list) and all(isinstance(a, str) for a in v) for v in lists.values()):
        return None
    return lists


def tasks_layout(tasks: Any, task: Any, nodes: Any) -> dict[str, Any]:
    """``nodes``, master address and port, and ``node_rank`` from a TF_CONFIG-style task list."""
    lists = _task_lists(tasks)
    if lists is None:
        return {}
    if lists.get("ps"):
        return _ps_layout(lists, tasks)
    if len(lists.get("chief", [])) > 1:
        raise TaskListError("cluster.tasks", tasks, f"cluster.tasks may list one chief; got {len(lists['chief'])}")
    ordered = ordered_tasks(lists)
    if not ordered:
        raise TaskListError("cluster.tasks", tasks, "cluster.tasks lists no node; give chief and/or worker addresses")
    try:
        (host, port), *others = [split_address(a) for a in ordered]
    except ValueError as exc:
        raise TaskListError("cluster.tasks", tasks, f"{exc}; every task is host:port") from None
    remote = next((h for h, _ in others if not is_loopback(h)), None)
    if is_loopback(host) and remote:
        raise TaskListError("cluster.tasks", tasks, f"the first task ({ordered[0]}) hosts the rendezvous on loopback, which "
                                                    f"{remote} cannot reach; give the first task's network address")
    if isinstance(nodes, int) and nodes != len(ordered):
        raise TaskListError("cluster.nodes", nodes, f"cluster.tasks lists {len(ordered)} node(s) but cluster.nodes is {nodes}; give one or the other")
    layout: dict[str, Any] = {"nodes": len(ordered), "master_addr": host, "master_port": port}
    layout.update(_task_rank(lists, task))
    return layout


def _ps_layout(lists: dict[str, list[str]], tasks: Any) -> dict[str, Any]:
    """A parameter-server cluster: one chief (its address hosts the RPC rendezvous), workers and ps tasks."""
    if len(lists.get("chief", [])) != 1:
        raise TaskListError("cluster.tasks", tasks, "a cluster with ps tasks needs exactly one chief (it hosts the RPC rendezvous)")
    try:
        hosts = [split_address(a)[0] for role in ("chief", "worker", "ps") for a in lists.get(role, [])]
    except ValueError as exc:
        raise TaskListError("cluster.tasks", tasks, f"{exc}; every task is host:port") from None
    if is_loopback(hosts[0]) and any(not is_loopback(h) for h in hosts[1:]):
        raise TaskListError("cluster.tasks", tasks, "the chief hosts the RPC rendezvous on loopback, which the other hosts "
                                                    "cannot reach; give the chief's network address")
    host, port = split_address(lists["chief"][0])
    return {"workers": len(lists.get("worker", [])), "ps": len(lists["ps"]), "master_addr": host, "master_port": port}


def _task_rank(lists: dict[str, list[str]], task: Any) -> dict[str, Any]:
    """``node_rank`` of ``cluster.task`` (empty when the task is not a well-formed one: pydantic says why)."""
    if not isinstance(task, dict) or task.get("type") not in ("chief", "worker"):
        return {}
    index = task.get("index", 0)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        return {}
    count = len(lists.get(task["type"], []))
    if index >= count:
        raise TaskListError("cluster.task", task, f"cluster.task {task['type']}:{index} is not in cluster.tasks ({count} {task['type']} task(s))")
    offset = 0 if task["type"] == "chief" else len(lists.get("chief", []))
    return {"node_rank": offset + index}
