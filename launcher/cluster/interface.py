"""Which network interface a node's collectives use: the one whose route reaches the master.

gloo, NCCL's bootstrap and tensorpipe each pick the address they listen on and
advertise to their peers. Left alone, gloo takes the address the machine's host
name resolves to, and on many machines (Debian's ``127.0.1.1 hostname`` line,
containers' ``127.0.0.1 hostname``) that is loopback: the rendezvous meets, then
the first collective fails with "Connection refused" to 127.0.0.1 on the peer.

A node of a multi-node job therefore asks the kernel which local address its
route to ``cluster.master_addr`` leaves from (what ``ip route get`` prints as
``src``), and which interface holds that address:

    >>> route_to("127.0.0.1")
    Route(interface='lo', address='127.0.0.1')
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import NamedTuple

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


class Route(NamedTuple):
    interface: str
    address: str


def route_to(host: str) -> Route | None:
    """This machine's interface and address towards ``host``; None when no route is found."""
    try:
        family, *_, target = socket.getaddrinfo(host, 9, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)  # UDP: no packet is sent, the kernel only chooses the route and its source
            local = probe.getsockname()[0]
    except OSError:
        return None
    name = interface_of(local)
    return Route(name, local) if name else None


def node_route(master_addr: str) -> Route | None:
    """The route a node of a multi-node job uses; None on one machine (loopback master: nothing changes)."""
    from launcher.cluster.address import is_loopback

    return None if is_loopback(master_addr) else route_to(master_addr)


def describe(master_addr: str, user_set: dict[str, str]) -> str:
    """The plan's line for this node: its interface and address, and what the collectives are told."""
    route = node_route(master_addr)
    if route is None:
        return f"no local route to {master_addr} (is it this cluster's address?); the collectives choose their own interface"
    told = ", ".join(f"{name}={user_set.get(name, route.interface)}{' (yours)' if name in user_set else ''}"
                     for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"))
    return f"this node reaches {master_addr} through {route.interface} ({route.address}); {told}"


def interface_of(address: str) -> str | None:
    """The interface holding ``address`` (an address of this machine), or None."""
    if ipaddress.ip_address(address).version == 6:
        return _interface_of_v6(address)
    for _, name in socket.if_nameindex():
        if address_of(name) == address:
            return name
    return None


def address_of(interface: str) -> str | None:
    """``interface``'s IPv4 address, or None when it has none (or does not exist)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _interface_of_v6(address: str) -> str | None:
    wanted = ipaddress.ip_address(address).exploded.replace(":", "")
    try:
        with open("/proc/net/if_inet6") as table:  # address, index, prefix, scope, flags, name
            for line in table:
                fields = line.split()
                if fields and fields[0] == wanted:
                    return fields[-1]
    except OSError:
        pass
    return None


def advertised(interface: str | None) -> tuple[str | None, str]:
    """The address gloo advertises to its peers, and why: ``interface``'s, or the host name's."""
    if interface:
        return address_of(interface), f"the address of interface {interface}"
    host = socket.gethostname()
    try:
        return socket.gethostbyname(host), f"the address the host name {host!r} resolves to"
    except OSError:
        return None, f"the host name {host!r}, which does not resolve"
