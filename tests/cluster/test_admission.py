"""Multi-node admission: a node without the job's cluster.token is refused, and both nodes say so."""

from __future__ import annotations

import stat
import subprocess

from launcher.cluster import admission
from launcher.config import compose as composer
from tests.conftest import command
from tests.launch.test_multi_node import free_port

TOKEN = "correct-horse-battery"


def test_answers_prove_the_token_without_showing_it():
    challenge = admission.challenge()
    answers = {0: admission.answer(TOKEN, challenge, 0), 1: admission.answer("another-token", challenge, 1),
               2: admission.answer(None, challenge, 2), 3: admission.answer(TOKEN, challenge, 3)}
    assert TOKEN not in "".join(answers.values())
    assert admission.refused(TOKEN, challenge, answers) == {
        1: "its cluster.token is not node 0's", 2: "it gave no cluster.token"}
    assert admission.refused(None, challenge, {1: answers[1]}) == {1: "it gave a cluster.token, but node 0 was started without one"}
    replayed = {1: admission.answer(TOKEN, challenge, 0)}  # rank 0's answer does not admit rank 1
    assert admission.refused(TOKEN, challenge, replayed)


def test_node_0_of_nodes_started_by_hand_makes_a_token_and_shows_it():
    def spec(*cluster: str):
        return composer.compose_and_validate(["strategy=mirrored", "cluster=2x1", "cluster.master_addr=10.0.0.1",
                                              "cluster.master_port=29500", *cluster], cuda_devices=0)

    made = admission.with_token(spec("cluster.node_rank=0"), scheduled=False)
    assert made.cluster.token and f"cluster.token={made.cluster.token}" in admission.describe(made)
    assert admission.with_token(spec("cluster.node_rank=0"), scheduled=True).cluster.token is None  # every task runs one command
    assert admission.with_token(spec("cluster.node_rank=1"), scheduled=False).cluster.token is None
    assert admission.with_token(spec("cluster.node_rank=0", f"cluster.token={TOKEN}"), scheduled=False).cluster.token == TOKEN


def test_node_0_keeps_the_token_it_made_for_its_runs_resumes(tmp_path):
    """``dlaunch resume RUN_DIR`` on every node: node 1 gives the token it was first started with, so node 0 takes
    the one it made again (kept owner-only in its run directory); a run begun afresh makes a new one."""
    def spec(*more: str):
        return composer.compose_and_validate(["strategy=mirrored", "cluster=2x1", "cluster.master_addr=10.0.0.1",
                                              "cluster.master_port=29500", "cluster.node_rank=0", *more], cuda_devices=0)

    kept = tmp_path / ".dlaunch" / "token"
    first = admission.with_token(spec(), scheduled=False, kept=kept).cluster.token
    assert kept.read_text().strip() == first and stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert admission.with_token(spec(), scheduled=False, kept=kept).cluster.token == first  # trainer.resume=auto
    afresh = admission.with_token(spec("trainer.resume=never"), scheduled=False, kept=kept).cluster.token
    assert afresh != first and kept.read_text().strip() == afresh
    given = admission.with_token(spec(f"cluster.token={TOKEN}"), scheduled=False, kept=tmp_path / "other")
    assert given.cluster.token == TOKEN and not (tmp_path / "other").exists()  # a token given is never written
    assert admission.with_token(spec(), scheduled=False).cluster.token not in (None, first)  # nowhere to keep it
    assert admission.with_token(spec(), scheduled=False, kept=kept, write=False).cluster.token == afresh
    kept.unlink()
    dry = admission.with_token(spec(), scheduled=False, kept=kept, write=False).cluster.token  # launch.dry_run
    assert dry and not kept.exists()


def node(tmp_path, rank: int, port: int, *extra: str) -> subprocess.Popen:
    args = ["recipe=linear", "strategy=mirrored", "cluster=2x1", f"cluster.node_rank={rank}", f"cluster.master_port={port}",
            "trainer.steps=5", "cluster.device=cpu", "launch.preflight_timeout_s=30", f"hydra.run.dir={tmp_path / f'node{rank}'}", *extra]
    return subprocess.Popen(command(*args), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_node_with_another_token_is_refused_on_both_sides(tmp_path):
    port, why = free_port(), "its cluster.token is not node 0's"  # no token at all: see the answers' test above
    first = node(tmp_path, 0, port, f"cluster.token={TOKEN}")
    second = node(tmp_path, 1, port, "cluster.token=not-the-token")
    _, err0 = first.communicate(timeout=180)
    _, err1 = second.communicate(timeout=60)
    err0, err1 = (" ".join(e.replace("│", " ").split()) for e in (err0, err1))
    assert first.returncode != 0 and second.returncode != 0
    assert "node 1 (host " in err0 and why in err0 and "refused node(s)" in err0, err0[-3000:]
    assert "refused this node 1" in err1 and why in err1 and "node 0's plan" in err1, err1[-3000:]
    for err in (err0, err1):
        assert TOKEN not in err.replace(f"cluster.token={TOKEN}", "") and "Traceback" not in err
        assert err.count("refused") <= 3  # one screen, not one per rank and layer
