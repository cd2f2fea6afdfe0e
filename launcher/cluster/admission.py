"""Multi-node admission: a node's ranks join only if the node knows the job's token.

c10d's TCPStore, which the rendezvous and the preflight meet in, authenticates
nobody (torch's SECURITY.md): anyone who reaches ``master_addr:master_port`` can
join. Before a node's ranks are admitted to the process group, each rank proves
that it holds ``cluster.token`` without writing the token where the store's
readers would see it: rank 0 writes a random challenge, each rank answers with
HMAC-SHA256(token, challenge + rank), and rank 0 checks every answer. A node
with no token or another one is refused, and both sides say so.

    >>> answer("s3cret-token", "abc", 1) == answer("s3cret-token", "abc", 1) != answer("other-token", "abc", 1)
    True
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

NO_TOKEN = "none"


def answer(token: str | None, challenge: str, rank: int) -> str:
    """What rank ``rank`` proves its token with; ``NO_TOKEN`` when it has none."""
    if not token:
        return NO_TOKEN
    return hmac.new(token.encode(), f"{challenge}/{rank}".encode(), hashlib.sha256).hexdigest()


def challenge() -> str:
    return secrets.token_hex(16)


def refused(token: str | None, challenge: str, answers: dict[int, str]) -> dict[int, str]:
    """The ranks whose answer does not prove ``token`` (node 0's), each with why."""
    out = {}
    for rank, given in answers.items():
        if hmac.compare_digest(given, answer(token, challenge, rank)):
            continue
        if given == NO_TOKEN:
            out[rank] = "it gave no cluster.token"
        elif not token:
            out[rank] = "it gave a cluster.token, but node 0 was started without one"
        else:
            out[rank] = "its cluster.token is not node 0's"
    return out


def needs_token(spec: Any, scheduled: bool) -> bool:
    """Node 0 of nodes started by hand across machines, with no token given: it makes one.

    Nodes that a scheduler or a TF_CONFIG task list starts all run the same
    command, so none could be told a token made by node 0; they give one or none.
    """
    c = spec.cluster
    return (c.token is None and c.nodes > 1 and c.node_rank == 0 and not c.loopback
            and not c.tasks and not scheduled)


def with_token(spec: Any, scheduled: bool, kept: Path | None = None, write: bool = True) -> Any:
    """``spec``, with a token for the job when node 0 must make one.

    ``kept``: the file (readable by its owner alone) where node 0 keeps the token it made for its run directory.
    A resume there (``trainer.resume`` other than never: ``dlaunch resume RUN_DIR`` on every node) takes it
    again, so the other nodes' resumes, which give the token they were first started with, are admitted.
    ``write=False`` (a dry run) shows the token the run would use and writes none.
    """
    if not needs_token(spec, scheduled):
        return spec
    token = _kept(kept) if kept is not None and spec.trainer.resume != "never" else None
    if token is None:
        token = secrets.token_urlsafe(16)
        if kept is not None and write:
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.unlink(missing_ok=True)  # a new file is made with the owner-only mode; an old one would keep its own
            fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(token + "\n")
    cluster = spec.cluster.model_copy(update={"token": token})
    return spec.model_copy(update={"cluster": cluster})


def _kept(path: Path) -> str | None:
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    return token or None


def describe(spec: Any) -> str:
    """The plan's line: what the other nodes must give."""
    c = spec.cluster
    if not c.token:
        return "no cluster.token: any node that reaches the rendezvous is admitted"
    if c.node_rank == 0:
        others = "1" if c.nodes == 2 else f"1..{c.nodes - 1}"
        return (f"nodes are admitted with this job's token; start the others with "
                f"cluster.node_rank={others} cluster.token={c.token}")
    return "this node proves cluster.token to node 0 before its ranks are admitted"
