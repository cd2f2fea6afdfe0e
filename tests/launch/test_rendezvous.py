"""The rendezvous store listens on loopback only."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.launch.rendezvous import free_port, listening_store

PROC_TCP = Path("/proc/net/tcp")


def listening_addresses(port: int) -> set[str]:
    """Local addresses in LISTEN state for ``port`` (IPv4 and IPv6)."""
    found = set()
    for table in (PROC_TCP, Path("/proc/net/tcp6")):
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(addr)
    return found


@pytest.mark.skipif(not PROC_TCP.exists(), reason="needs Linux /proc/net/tcp")
def test_store_listens_on_127_0_0_1_only():
    store = listening_store("127.0.0.1", 0)
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 nor ::


def test_a_node_rank_claim_is_taken_over_only_from_a_node_that_is_gone():
    import os
    import subprocess
    import sys

    from torch.distributed import HashStore, PrefixStore
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError

    from launcher.launch.rendezvous import announce, claim_of_this_process, joined_nodes

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, nodes = int(ended.stdout), PrefixStore("nodes", HashStore())
    mine = claim_of_this_process("hostA")
    ns = mine.rsplit(" ", 1)[1].rstrip(")")
    announce(nodes, 1, f"hostA (pid {dead_pid}, pidns {ns})")
    announce(nodes, 1, mine)  # the same host and pid namespace, and that process has ended: taken over
    with pytest.raises(RendezvousStateError, match=r"node_rank=1 is already taken by hostA \(pid"):
        announce(nodes, 1, f"hostA (pid 1, pidns {ns})")  # a live process holds it
    with pytest.raises(RendezvousStateError, match="already taken"):
        announce(nodes, 1, f"hostB (pid 123, pidns {ns})")  # another host's: it cannot be known to be gone
    announce(nodes, 3, f"hostA (pid {dead_pid}, pidns 1)")
    with pytest.raises(RendezvousStateError, match="already taken"):
        announce(nodes, 3, mine)  # another pid namespace (a container) on a host of the same name
    nodes.compare_set("node2", "", "")  # released on the way out
    announce(nodes, 2, "hostB (pid 123, pidns 9)")
    assert joined_nodes(nodes, 4) == {1: mine, 2: "hostB (pid 123, pidns 9)", 3: f"hostA (pid {dead_pid}, pidns 1)"}


def test_a_stop_signal_during_the_failed_node_check_stops_the_agent_and_is_not_swallowed():
    """The agent asks node 0's store every monitor pass whether another node failed, inside ``except Exception``
    (a store gone is no failure of this node). A Ctrl-C landing during that call raised torch's SignalException
    there, which the except swallowed: the run trained on, the stop lost (1 in ~15 under load). The store stands in
    for one whose answer the signal interrupts; the signal and torch's own handler are real."""
    import os
    import signal
    import types

    from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler

    from launcher.launch import rendezvous

    class Interrupted:
        def check(self, keys):
            os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: inside failed_peer's try
            return False

    before = signal.signal(signal.SIGINT, _terminate_process_handler)
    try:
        with pytest.raises(SignalException):
            rendezvous.failed_peer(types.SimpleNamespace(nodes=Interrupted()))
    finally:
        signal.signal(signal.SIGINT, before)

    class Gone:  # node 0's store is gone: no failure of this node
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

    assert rendezvous.failed_peer(types.SimpleNamespace(nodes=Gone())) is None


RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE.exists(), reason="needs Linux's ephemeral port range")
def test_a_picked_port_is_below_the_ports_the_kernel_hands_out_so_no_connection_can_take_it_meanwhile():
    """CI once lost a parameter-server test: the chief's picked port was taken by another test's connection."""
    import random
    import socket

    low = int(RANGE.read_text().split()[0])
    ports = set()
    for _ in range(3):  # a seed a test set (in every process alike) does not make the picks alike
        random.seed(0)
        ports.add(free_port())
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
    with socket.create_server(("127.0.0.1", ports.pop())):  # and it binds
        pass


def test_without_a_known_ephemeral_range_the_kernel_picks(tmp_path, monkeypatch):
    from launcher.launch import rendezvous

    assert rendezvous._ephemeral_low(str(tmp_path / "missing")) == 0
    monkeypatch.setattr(rendezvous, "_ephemeral_low", lambda: 0)
    assert 0 < free_port() < 65536
