"""Two real hosts: two network namespaces joined by a veth pair, each running its node's ``dlaunch``.

The machine's host name resolves to loopback (127.0.0.1 here; Debian's
``127.0.1.1 hostname`` line does the same), so gloo, left alone, advertises an
address the other host cannot reach. Each node must pick the interface whose
route reaches the master. Needs root and ``ip netns``; skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from tests.conftest import command
from tests.launch.test_multi_node import COMMON, free_port, params

pytestmark = pytest.mark.slow
ADDRESSES = ("10.231.0.1", "10.231.0.2")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"dl-probe-{os.getpid()}"
    made = _ip("netns", "add", probe)
    _ip("netns", "del", probe)
    return None if made.returncode == 0 else f"`ip netns add` fails here: {made.stderr.strip()}"


@pytest.fixture
def two_hosts():
    """Two namespaces, host0 (10.231.0.1) and host1 (10.231.0.2), on one veth link; removed after the test."""
    why = _unavailable()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}"
    names = [f"dl{tag}h{i}" for i in range(2)]
    links = [f"dl{tag}v{i}" for i in range(2)]
    try:
        for name in names:
            assert _ip("netns", "add", name).returncode == 0
        assert _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1]).returncode == 0
        for name, link, address in zip(names, links, ADDRESSES):
            for cmd in (("link", "set", link, "netns", name), ("-n", name, "addr", "add", f"{address}/24", "dev", link),
                        ("-n", name, "link", "set", link, "up"), ("-n", name, "link", "set", "lo", "up")):
                result = _ip(*cmd)
                assert result.returncode == 0, result.stderr
        yield dict(zip(names, links))
    finally:
        for name in names:
            _ip("netns", "del", name)  # takes its end of the veth pair, and so the pair, with it


def node(tmp_path, host: str, rank: int, port: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    args = [*COMMON, "cluster=2x1", f"cluster.master_addr={ADDRESSES[0]}", f"cluster.master_port={port}",
            f"cluster.node_rank={rank}", "cluster.token=two-hosts-token", "cluster.device=cpu",
            "launch.preflight_timeout_s=30", f"hydra.run.dir={tmp_path / f'node{rank}'}", *extra]
    variables = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    return subprocess.Popen(["ip", "netns", "exec", host, *command(*args)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**variables, **(env or {})})


def run_both(tmp_path, hosts, port, env1: dict | None = None):
    host0, host1 = hosts
    first = node(tmp_path, host0, 0, port)
    second = node(tmp_path, host1, 1, port, env=env1)
    out0, err0 = first.communicate(timeout=240)
    out1, err1 = second.communicate(timeout=60)
    err0, err1 = out0 + err0, out1 + err1  # the plan is on stdout, logs and errors on stderr
    return (first.returncode, " ".join(err0.replace("│", " ").split())), (second.returncode, " ".join(err1.replace("│", " ").split()))


def test_a_2x1_job_across_two_hosts_equals_1x2_on_one_bit_for_bit(tmp_path, two_hosts, run_dlaunch):
    (code0, err0), (code1, err1) = run_both(tmp_path, list(two_hosts), free_port())
    assert code0 == 0, err0[-3000:]
    assert code1 == 0, err1[-3000:]
    link1 = list(two_hosts.values())[1]
    assert f"through {link1} ({ADDRESSES[1]}); GLOO_SOCKET_IFNAME={link1}" in err1  # the plan names node 1's interface

    proc, one_host = run_dlaunch(*COMMON, "cluster=1x2", name="one_host")
    assert proc.returncode == 0, proc.stderr[-3000:]
    across, here = params(tmp_path / "node0"), params(one_host)
    assert across.keys() == here.keys()
    assert all(torch.equal(across[k], here[k]) for k in here)


def test_a_rank_that_advertises_loopback_is_named_with_the_variable_to_set(tmp_path, two_hosts):
    # node 1's user pins gloo to lo: its peers on the other host could never connect to it
    (code0, err0), (code1, err1) = run_both(tmp_path, list(two_hosts), free_port(), env1={"GLOO_SOCKET_IFNAME": "lo"})
    assert code0 != 0 and code1 != 0
    for err in (err0, err1):
        assert "node 1 (host " in err and "127.0.0.1, the address of interface lo" in err, err[-3000:]
        assert f"set GLOO_SOCKET_IFNAME on node 1 to the interface that reaches {ADDRESSES[0]}" in err
        assert "Traceback" not in err and "connectFullMesh" not in err


def test_a_rank_that_advertises_an_address_its_peers_cannot_route_to_is_named(tmp_path, two_hosts):
    # node 1's user pins gloo to an interface on another network (10.232.0.0/24), to which host0 has no route
    host1 = list(two_hosts)[1]
    stray, peer = f"{host1}x", f"{host1}y"
    for cmd in (("link", "add", stray, "type", "veth", "peer", "name", peer), ("addr", "add", "10.232.0.2/24", "dev", stray),
                ("link", "set", stray, "up"), ("link", "set", peer, "up")):
        result = _ip("-n", host1, *cmd)
        assert result.returncode == 0, result.stderr
    (code0, err0), (code1, err1) = run_both(tmp_path, list(two_hosts), free_port(), env1={"GLOO_SOCKET_IFNAME": stray})
    assert code0 != 0 and code1 != 0
    for err in (err0, err1):
        assert "node 1 (host " in err and f"10.232.0.2, the address of interface {stray} (node 0: " in err, err[-3000:]
        assert f"set GLOO_SOCKET_IFNAME on node 1 to the interface that reaches {ADDRESSES[0]}" in err
        assert "Traceback" not in err and "connectFullMesh" not in err
