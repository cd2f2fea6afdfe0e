"""The workers' environment: single-node jobs keep every collective transport on loopback."""

from __future__ import annotations

from launcher.cluster.env import LOOPBACK_INTERFACE_VARIABLES, worker_environment


def test_single_node_collectives_stay_on_loopback(monkeypatch):
    for name in LOOPBACK_INTERFACE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    env = worker_environment(single_node=True)
    assert {env[name] for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")} == {env["GLOO_SOCKET_IFNAME"]}
    assert env["GLOO_SOCKET_IFNAME"].startswith("lo")


def test_a_users_interface_wins_and_several_nodes_use_the_network(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert worker_environment(single_node=True)["NCCL_SOCKET_IFNAME"] == "ib0"
    assert not set(LOOPBACK_INTERFACE_VARIABLES) & set(worker_environment(single_node=False))
