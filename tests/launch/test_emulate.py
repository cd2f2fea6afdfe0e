"""Emulated nodes' agents (launcher/launch/emulate.py): a node after the first that dies is noticed."""

from __future__ import annotations

import subprocess
import sys
import time

from launcher.launch import emulate


def test_a_later_node_that_dies_ends_the_wait_while_node_0_still_runs(tmp_path):
    """The wait polled the nodes with any(), which stopped at node 0's running agent: node 1's exit was never
    read, so the failure's grace period never began, and dlaunch waited for node 0 (300 s in torch's exit barrier)."""
    node0 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    node1 = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        started = time.monotonic()
        codes = emulate._wait([node0, node1], grace_s=1.0, marker=tmp_path / "teardown")
        assert codes[1] == 3 and codes[0] != 0 and time.monotonic() - started < 60
        assert (tmp_path / "teardown").exists()  # node 0's agent is told it is a teardown, not a stop
    finally:
        node0.kill()
        node0.wait()
