"""Several nodes on loopback: emulated (one agent per node) and as separate ``dlaunch`` commands."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

from launcher.launch.rendezvous import free_port
from tests.conftest import PROBE, command, summary

pytestmark = pytest.mark.slow
COMMON = ("recipe=linear", "strategy=mirrored", "trainer.steps=30", "trainer.log_every=10",
          f"recipe.entry={PROBE}", "+recipe.save_params=true", "+recipe.record_env=true", "input.global_batch_size=32")


def params(run_dir):
    return torch.load(run_dir / "params.pt", weights_only=True)


def assert_same_model(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def ranks_seen(run_dirs) -> dict[int, dict]:
    found = {}
    for run_dir in run_dirs:
        for path in run_dir.glob("env-rank*.json"):
            data = json.loads(path.read_text())
            found[data["rank"]] = data
    return found


def assert_real_2x2_ranks(found):
    assert sorted(found) == [0, 1, 2, 3]
    for rank, env in found.items():
        assert (env["group_rank"], env["local_rank"]) == divmod(rank, 2), env
        assert (env["world_size"], env["local_world_size"]) == (4, 2)


def node_command(tmp_path, node_rank, port, *extra):
    args = [*COMMON, "cluster=2x2", f"cluster.node_rank={node_rank}", f"cluster.master_port={port}",
            f"hydra.run.dir={tmp_path / f'node{node_rank}'}", *extra]
    return subprocess.Popen(command(*args, warm=False), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_emulated_2x2_equals_one_device(run_dlaunch):
    """A flat 1x4 run was compared too. It added a 4-rank job and nothing more: one node's ranks equal one device
    in test_equivalence (1x2), and these four ranks do here."""
    proc, emulated = run_dlaunch(*COMMON, "cluster=2x2", name="emulated")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "emulated on this machine" in proc.stdout + proc.stderr
    assert_real_2x2_ranks(ranks_seen([emulated]))
    assert summary(emulated)["world_size"] == 4

    proc, one = run_dlaunch(*[a for a in COMMON if a != "strategy=mirrored"], "strategy=one_device", name="one")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_model(params(emulated), params(one))

    # Hierarchical all-reduce over the emulated nodes' real groups: reduce in node, across leaders, broadcast.
    proc, tiered = run_dlaunch(*COMMON, "cluster=2x2", "strategy.cross_device_ops=hierarchical_copy", name="tiered")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_model(params(emulated), params(tiered))


def test_two_dlaunch_commands_form_one_2x2_job(tmp_path, run_dlaunch):
    port = free_port()
    later = node_command(tmp_path, 1, port)  # node 1 first: it waits for node 0's store
    time.sleep(1)
    first = node_command(tmp_path, 0, port)
    out0, err0 = first.communicate(timeout=180)
    out1, err1 = later.communicate(timeout=60)
    assert first.returncode == 0, err0[-3000:]
    assert later.returncode == 0, err1[-3000:]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    assert summary(node0)["status"] == "completed" and not (node1 / "summary.json").exists()
    assert "rank 0 wrote the results on node 0" in err1
    assert_real_2x2_ranks(ranks_seen([node0, node1]))

    proc, one = run_dlaunch(*[a for a in COMMON if a != "strategy=mirrored"], "strategy=one_device", name="one")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_model(params(node0), params(one))


def test_a_node_that_never_comes_is_named_after_the_rendezvous_timeout(tmp_path):
    port = free_port()
    start = time.monotonic()
    alone = node_command(tmp_path, 0, port, "launch.rdzv_timeout_s=5")
    _, err = alone.communicate(timeout=60)
    assert time.monotonic() - start < 60  # the 5 s timeout asked for plus start-up on a busy machine, not the default
    assert alone.returncode == 1
    assert "missing: node 1 (ranks 2-3)" in err and "cluster.node_rank" in err
    assert "Traceback" not in err
    # the run's record says so too, for whatever polls summary.json: it held only config.yaml and the logs
    record = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert record["status"] == "failed" and "the nodes could not meet" in record["error"]["exception"], record
    assert "missing: node 1" in (tmp_path / "node0" / "error.txt").read_text()


def test_a_missing_node_0_is_named(tmp_path):
    port = free_port()
    alone = node_command(tmp_path, 1, port, "launch.rdzv_timeout_s=3")
    _, err = alone.communicate(timeout=60)
    assert alone.returncode == 1
    assert "missing node 0" in " ".join(err.split()) and "Traceback" not in err


def test_nodes_started_with_different_configs_stop_with_the_keys(tmp_path):
    port = free_port()
    node1 = node_command(tmp_path, 1, port, "trainer.steps=31")
    node0 = node_command(tmp_path, 0, port)
    _, err0 = node0.communicate(timeout=240)  # past 120 s on a slow day
    _, err1 = node1.communicate(timeout=60)
    assert node0.returncode == 1 and node1.returncode == 1
    for err in (err0, err1):
        assert "trainer.steps: 30 on node 0, 31 on node 1" in " ".join(err.split())


def test_a_failure_on_node_1_is_shown_once_by_the_emulating_parent(run_dlaunch):
    proc, run_dir = run_dlaunch(*COMMON, "cluster=2x2", "+recipe.fail_replica=3", name="fail")
    assert proc.returncode == 1
    assert proc.stderr.count("root cause") == 1 and "injected failure on replica 3" in proc.stdout + proc.stderr
    assert summary(run_dir)["error"]["rank"] == 3


def test_a_node_stopped_while_the_others_wait_is_stopped_cleanly_and_can_join_again(tmp_path):
    """SIGTERM during the rendezvous killed dlaunch with no word (the default action); the node's claim on its
    node rank then outlived it, and the same command started again was refused as a duplicate node rank."""
    port = free_port()

    def node(rank: int, name: str) -> subprocess.Popen:
        args = [*COMMON, "cluster=3x1", "input.global_batch_size=33", f"cluster.node_rank={rank}",
                f"cluster.master_port={port}", f"hydra.run.dir={tmp_path / name}"]
        return subprocess.Popen(command(*args, warm=False), cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    node0, node1 = node(0, "node0"), node(1, "node1")
    log = tmp_path / "node1" / "dlaunch.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "through torch.distributed.elastic" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # into the rendezvous, which waits for node 2
    node1.send_signal(15)
    _, err1 = node1.communicate(timeout=60)
    assert node1.returncode == 143 and "stopped by SIGTERM" in err1, err1[-3000:]
    again, node2 = node(1, "node1-again"), node(2, "node2")
    _, err0 = node0.communicate(timeout=240)
    for proc in (again, node2):
        proc.communicate(timeout=60)
    assert node0.returncode == 0 and again.returncode == 0 and node2.returncode == 0, err0[-3000:]
    assert summary(tmp_path / "node0")["status"] == "completed"


def test_nodes_with_their_own_run_directories_restart_from_the_same_shared_checkpoint(tmp_path):
    """Each node keeps its own run directory and shares only trainer.checkpoint.dir: after a restart every node must
    resume from the same step (a marker in node 0's run directory sent node 1 back to step 0, and the ranks hung
    in their check that they agree)."""
    port, shared = free_port(), tmp_path / "ckpt"
    extra = ("cluster=2x1", "trainer.steps=12", "trainer.log_every=1", "trainer.checkpoint.every_steps=4",
             f"trainer.checkpoint.dir={shared}", "launch.max_restarts=1", "trainer.resume=never",
             "+recipe.pause_replica=1", "+recipe.pause_step=6", "launch.collective_timeout_s=60")
    nodes = [subprocess.Popen(command(*COMMON, *extra, f"cluster.node_rank={n}", f"cluster.master_port={port}",
                                      f"hydra.run.dir={tmp_path / f'node{n}'}", warm=False),
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    try:
        paused = tmp_path / "node1" / "paused-replica1"
        deadline = time.monotonic() + 180
        while not (paused.exists() and paused.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        subprocess.run(["kill", "-9", paused.read_text().strip()], check=True)  # replica 1, inside step 6
        outs = [p.communicate(timeout=240)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "step-00000004" in outs[0].split("resumed from", 1)[1].splitlines()[0], outs[0][-3000:]  # rank 0's log
    s = summary(tmp_path / "node0")  # and both ranks agreed on it: the run went on to its end
    assert (s["status"], s["restarts"], s["resumed_from_step"]) == ("completed", 1, 4)


def test_nodes_whose_checkpoint_directories_are_not_shared_stop_before_they_save_a_split_checkpoint(tmp_path):
    """Two node commands with their own run directories and the default trainer.checkpoint.dir (RUN_DIR/checkpoints):
    each node's ranks would write their part of every checkpoint to their own disk, and rank 0 would verify only its
    own part. Every node must see the directory rank 0 writes to; here both stop, naming node 1, before step 1."""
    port = free_port()
    nodes = [node_command(tmp_path, n, port, "trainer.checkpoint.every_steps=10") for n in (1, 0)]
    errs = [p.communicate(timeout=180)[1] for p in nodes]
    assert [p.returncode for p in nodes] == [1, 1], errs[1][-3000:]
    said = " ".join(errs[1].split())
    assert "is not shared by the nodes: node 1 does not see what node 0 writes there" in said, said[-3000:]
    assert not list((tmp_path / "node0" / "checkpoints").glob("step-*"))


def test_a_node_killed_and_started_again_rejoins_under_max_restarts(tmp_path):
    """Node 1's dlaunch SIGKILLed mid-run, then its command started again (OPERATIONS.md): torch's rendezvous wrote
    node 0's store address in its first round only, so the new node waited for it in round 1 while node 0 waited for
    the new node, and both failed at the rendezvous timeout with a traceback; then the new node's workers, counting
    their restarts from 0, read the dead first attempt's keys. Now the run resumes from the shared checkpoint."""
    port, shared = free_port(), tmp_path / "ckpt"
    extra = ("cluster=2x1", "trainer.steps=24", "trainer.log_every=1", "trainer.checkpoint.every_steps=4",
             f"trainer.checkpoint.dir={shared}", "launch.max_restarts=1", "launch.rdzv_timeout_s=90",
             "+recipe.step_sleep=0.2")

    def node(rank: int, name: str) -> subprocess.Popen:
        return subprocess.Popen(command(*COMMON, *extra, f"cluster.node_rank={rank}", f"cluster.master_port={port}",
                                        f"hydra.run.dir={tmp_path / name}", warm=False),
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    nodes = [node(0, "node0"), node(1, "node1")]
    try:
        deadline = time.monotonic() + 180
        while not (shared / "step-00000008").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        nodes[1].kill()  # dlaunch itself: its worker follows it
        nodes[1].communicate(timeout=60)
        nodes.append(node(1, "node1-again"))
        outs = [p.communicate(timeout=240)[0] for p in (nodes[0], nodes[2])]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [nodes[0].returncode, nodes[2].returncode] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "Traceback" not in outs[0] + outs[1] and "Gloo connectFullMesh failed" not in outs[1], outs[1][-3000:]
    s = summary(tmp_path / "node0")
    assert (s["status"], s["restarts"]) == ("completed", 1) and s["resumed_from_step"] >= 8, s


def test_nodes_started_for_different_node_counts_are_named_at_once(tmp_path):
    """Node 0 at 2x1 and node 1 at 3x1: both waited out the rendezvous timeout (node 1 with a traceback, 'The
    connection to the C10d store has failed') and neither named the difference."""
    port = free_port()

    def node(rank: int, shape: str) -> subprocess.Popen:
        args = [*COMMON, f"cluster={shape}", "input.global_batch_size=30", f"cluster.node_rank={rank}",
                f"cluster.master_port={port}", "launch.rdzv_timeout_s=20", f"hydra.run.dir={tmp_path / f'node{rank}'}"]
        return subprocess.Popen(command(*args, warm=False), cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    node0 = node(0, "2x1")
    time.sleep(2)
    started = time.monotonic()
    node1 = node(1, "3x1")
    _, err1 = node1.communicate(timeout=120)
    assert node1.returncode == 1 and time.monotonic() - started < 20, err1[-3000:]  # before the timeout
    assert "node 0 was started with a cluster of 2 nodes, this node (node 1) with 3" in err1, err1[-3000:]
    _, err0 = node0.communicate(timeout=120)
    assert node0.returncode == 1 and "node 1 came with a cluster of 3 nodes (this one: 2)" in err0, err0[-3000:]
    assert "Traceback" not in err0 + err1
