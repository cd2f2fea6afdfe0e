"""The rendezvous store listens on loopback only."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.launch.rendezvous import listening_store

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
