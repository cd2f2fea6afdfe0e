"""The interface a node's collectives use: the one whose route reaches the master (no processes)."""

from __future__ import annotations

import socket

import pytest

from launcher.cluster import interface
from launcher.cluster.env import LOOPBACK_INTERFACE_VARIABLES, worker_environment


def routable_interface() -> tuple[str, str] | None:
    for _, name in socket.if_nameindex():
        address = interface.address_of(name)
        if address and not address.startswith("127."):
            return name, address
    return None


def test_the_route_to_loopback_is_lo_and_one_machine_changes_nothing():
    assert interface.route_to("127.0.0.1") == ("lo", "127.0.0.1")
    assert interface.node_route("localhost") is None
    assert worker_environment(single_node=False, environ={}, interface=None).keys().isdisjoint(LOOPBACK_INTERFACE_VARIABLES)


def test_the_route_to_this_machines_own_address_leaves_from_the_interface_that_holds_it():
    found = routable_interface()
    if found is None:
        pytest.skip("this machine has no interface with a non-loopback IPv4 address")
    name, address = found
    # `ip route get` says "local ... dev lo" here; the interface that holds the address is what peers reach
    assert interface.route_to(address) == (name, address)
    assert interface.interface_of(address) == name
    assert interface.describe(address, {"GLOO_SOCKET_IFNAME": "eth7"}) == (
        f"this node reaches {address} through {name} ({address}); "
        f"GLOO_SOCKET_IFNAME=eth7 (yours), NCCL_SOCKET_IFNAME={name}, TP_SOCKET_IFNAME={name}")


def test_a_node_sets_the_three_variables_to_its_interface_unless_the_user_set_them():
    env = worker_environment(single_node=False, environ={"GLOO_SOCKET_IFNAME": "eth7"}, interface="veth1")
    assert {k: env[k] for k in LOOPBACK_INTERFACE_VARIABLES} == {
        "GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "veth1", "TP_SOCKET_IFNAME": "veth1"}


def test_gloo_advertises_the_host_names_address_when_no_interface_is_set():
    address, how = interface.advertised(None)
    assert socket.gethostname() in how
    assert interface.advertised("lo") == ("127.0.0.1", "the address of interface lo")
    assert interface.advertised("no-such-if0")[0] is None
    assert address is None or address.count(".") == 3
