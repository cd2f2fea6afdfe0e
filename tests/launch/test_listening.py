"""Where dlaunch listens: loopback only for a single-node job; a network bind is logged with its reason."""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher.config import compose as composer
from launcher.launch import elastic
from tests.conftest import command

PROC = Path("/proc")
LISTEN = "0A"


def listening_sockets() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every TCP socket in LISTEN state, IPv4 and IPv6."""
    found = {}
    for table, width in (("tcp", 4), ("tcp6", 16)):
        path = PROC / "net" / table
        for line in path.read_text().splitlines()[1:] if path.exists() else []:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            host_order = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))  # /proc prints 32-bit words
            found[int(fields[9])] = (str(ipaddress.ip_address(host_order)), int(hex_port, 16))
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in (PROC / str(pid) / "fd").iterdir():
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    except OSError:  # the process ended, or one fd closed while we looked
        pass
    return inodes


def process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it."""
    parents = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text.rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return tree


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def wait_for_training(metrics: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"dlaunch exited with {proc.returncode} before training"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            return
        time.sleep(0.2)
    raise AssertionError(f"no training steps in {metrics} after {timeout_s} s")


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(proc: subprocess.Popen, started: set[int]) -> set[int]:
    """Stop dlaunch (SIGTERM, then SIGKILL) and any process of its tree still alive; return those left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 15
    alive = {pid for pid in started if running(pid)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {pid for pid in alive if running(pid)}
    for pid in alive:  # only processes of this job's tree, by pid
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


@pytest.mark.slow
@pytest.mark.skipif(not (PROC / "net" / "tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_a_single_node_job_listens_on_loopback_only(tmp_path):
    run_dir = tmp_path / "run"
    argv = command("strategy=mirrored", "cluster=1x2", "trainer.steps=1000000", "trainer.log_every=1", f"hydra.run.dir={run_dir}")
    with (tmp_path / "output.txt").open("w") as output:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=output, stderr=subprocess.STDOUT)
    tree: set[int] = {proc.pid}
    try:
        wait_for_training(run_dir / "metrics.jsonl", proc, timeout_s=180)
        tree = process_tree(proc.pid)
        sockets = listening_sockets()
        listening = {(pid, *sockets[inode]) for pid in tree for inode in socket_inodes(pid) if inode in sockets}
        assert len(tree) >= 3, f"dlaunch and its two workers: {tree}"
        assert any(pid == proc.pid for pid, _, _ in listening), "the rendezvous store listens in dlaunch itself"
        exposed = sorted(entry for entry in listening if not is_loopback(entry[1]))
        assert not exposed, f"(pid, address, port) listening beyond loopback: {exposed}; all: {sorted(listening)}"
    finally:
        left = stop(proc, tree | process_tree(proc.pid))
    assert not left, f"processes left running after dlaunch was stopped: {left}"


# ---------- the log line that explains a network bind ----------
def _launch_logging(monkeypatch, tmp_path, caplog, overrides: list[str]) -> list[str]:
    spec = composer.compose_and_validate(overrides, cuda_devices=0)
    monkeypatch.setattr(elastic, "run_node", lambda *args, **kwargs: 0)  # start nothing
    monkeypatch.setattr("launcher.launch.emulate.run", lambda *args, **kwargs: 0)
    with caplog.at_level(logging.INFO, logger="dlaunch"):
        assert elastic.launch(spec, tmp_path, 0) == 0
    return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "listen" in r.getMessage()]


def test_a_network_bind_is_logged_with_its_address_and_reason(monkeypatch, tmp_path, caplog):
    # node 0 of its cluster (10.0.0.1 is no address of this machine: without a node rank, a config error)
    (line,) = _launch_logging(monkeypatch, tmp_path, caplog, ["strategy=mirrored", "cluster=1x2", "cluster.master_addr=10.0.0.1",
                                                              "cluster.master_port=29500", "cluster.node_rank=0"])
    assert line.startswith("the rendezvous listens on 10.0.0.1:29500 ")
    assert "because cluster.master_addr=10.0.0.1 names a network address" in line


def test_other_nodes_log_that_their_collectives_use_the_network(monkeypatch, tmp_path, caplog):
    (line,) = _launch_logging(monkeypatch, tmp_path, caplog, [
        "strategy=mirrored", "cluster=tasks", "cluster.tasks={chief: ['10.0.0.1:29500'], worker: ['10.0.0.2:29500']}",
        "cluster.task={type: worker, index: 0}"])
    assert "collectives (gloo/NCCL) listen on this machine's network interface" in line
    assert "because cluster.tasks names hosts on the network" in line


@pytest.mark.parametrize("overrides", [["strategy=mirrored", "cluster=1x2"], ["strategy=mirrored", "cluster=2x2"],
                                       ["strategy=mirrored", "cluster=1x2", "cluster.master_addr=::1"]])
def test_a_loopback_job_logs_no_network_bind(overrides, monkeypatch, tmp_path, caplog):
    assert _launch_logging(monkeypatch, tmp_path, caplog, overrides) == []
