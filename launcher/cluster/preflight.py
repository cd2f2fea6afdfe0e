"""Before training: every rank shows up, with the same config, and a collective works.

Each rank announces itself in the job's store and waits a short time for all
the others. On several nodes, a node's ranks are admitted only if they prove
the job's ``cluster.token`` (cluster/admission.py), and every rank must
advertise an address its peers on other nodes can reach (not loopback). A rank that never comes is named, with its node and where it was
expected, instead of the job hanging in its first collective. Ranks also
compare a hash of the validated config, so two nodes started with different
settings stop with the keys that differ. Then the process group is joined and
a one-element all-reduce must return the world size in time.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from launcher.cluster import admission, interface, reach
from launcher.cluster.address import is_loopback
from launcher.cluster.env import WorkerEnv, collective_interface
from launcher.cluster.process_group import ensure_process_group, job_store, process_device

# differ between nodes by design; a token that differs is the admission's to name, never shown. trainer.resume: each
# node's dlaunch names the checkpoint it verified (a node started again names one, while the workers a node restarts
# find the newest themselves, under `auto`); the ranks compare the step they resume from (checkpoint.agree).
PER_NODE_KEYS = (("cluster", "node_rank"), ("cluster", "task"), ("cluster", "token"), ("trainer", "resume"))


class PreflightError(RuntimeError):
    """Some ranks did not join, disagree about the config, or cannot all-reduce."""

    explained = True  # the message names ranks, nodes and keys: a traceback adds nothing


def check(env: WorkerEnv, spec: dict[str, Any], timeout_s: float, backend: str, device_type: str, collective_timeout_s: float = 300) -> None:
    """Run every check on this rank; raise ``PreflightError`` naming what is wrong."""
    store = job_store(env, f"dlaunch/preflight/{env.run_id}/{env.attempt}", timeout_s)
    shared = _shared_part(spec, backend, device_type)
    _announce(store, env, shared, backend)
    _wait_for_all(store, env, timeout_s)
    if env.world_size > env.local_world_size:  # several nodes
        _admit(store, env, spec["cluster"].get("token"), timeout_s)
        _reachable(store, _present(store, env.world_size), env, spec["cluster"]["master_addr"], timeout_s)
    _same_config(store, env, shared)
    ensure_process_group(env, backend, collective_timeout_s, device_type)
    _all_reduce(env, device_type, timeout_s)


def _shared_part(spec: dict[str, Any], backend: str, device_type: str) -> dict[str, Any]:
    """What every node must agree on: the config but for its own keys, and what ``auto`` resolved to on it (a node
    without GPUs would pick gloo where the others pick nccl, and the process group would never form)."""
    shared = json.loads(json.dumps(spec))
    for section, key in PER_NODE_KEYS:
        shared.get(section, {}).pop(key, None)
    return {**shared, "resolved here (cluster.device/backend=auto)": {"device": device_type, "backend": backend}}


def _digest(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _announce(store: dist.Store, env: WorkerEnv, shared: dict[str, Any], backend: str) -> None:
    where = {"host": socket.gethostname(), "pid": os.getpid(), "node": env.group_rank, "config": _digest(shared),
             **_advertised(backend)}
    if env.rank == 0:  # before rank 0 announces itself: a rank that saw every announcement finds the challenge
        store.set("challenge", admission.challenge())
    if env.local_rank == 0:  # one copy of each node's config, to name the keys that differ
        store.set(f"config-node{env.group_rank}", json.dumps(shared))
    store.set(f"rank{env.rank}", json.dumps(where))


def _present(store: dist.Store, world_size: int) -> dict[int, dict]:
    return {r: json.loads(store.get(f"rank{r}")) for r in range(world_size) if store.check([f"rank{r}"])}


def _wait_for_all(store: dist.Store, env: WorkerEnv, timeout_s: float) -> None:
    keys = [f"rank{r}" for r in range(env.world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError: some rank never announced itself
        present = _present(store, env.world_size)
        if len(present) < env.world_size:  # else the last came just as the wait gave up (a busy machine): go on
            raise PreflightError(missing_ranks_message(present, env, timeout_s)) from None


def missing_ranks_message(present: dict[int, dict], env: WorkerEnv, timeout_s: float) -> str:
    """Which ranks never joined, on which nodes, and where those nodes' other ranks are."""
    per_node = env.local_world_size
    hosts = {info["node"]: info["host"] for info in present.values()}
    missing = [r for r in range(env.world_size) if r not in present]
    lines = [f"{len(present)} of {env.world_size} ranks joined within {timeout_s:g} s; missing:"]
    for node in sorted({r // per_node for r in missing}):
        ranks = [r for r in missing if r // per_node == node]
        where = f"on host {hosts[node]}" if node in hosts else "no rank of this node joined"
        local = ", ".join(str(r % per_node) for r in ranks)
        lines.append(f"  node {node}: rank(s) {', '.join(map(str, ranks))} (local rank {local}; {where})")
    lines.append("a missing rank crashed or hangs before training (see its log under the run's logs/), "
                 "or cannot reach the store at " f"{env.master_addr}:{env.master_port}")
    return "\n".join(lines)


def _advertised(backend: str) -> dict[str, Any]:
    """The address this rank's collectives advertise to their peers, and what chose it."""
    variable, name = collective_interface(backend)
    if backend == "nccl" and name is None:
        return {}  # NCCL picks a non-loopback interface itself
    addr, how = interface.advertised(name)
    return {"addr": addr, "how": how, "variable": variable}


def _admit(store: dist.Store, env: WorkerEnv, token: str | None, timeout_s: float) -> None:
    """Rank 0 checks every rank's answer to its challenge; every rank learns the verdict, refused nodes by name."""
    challenge = store.get("challenge").decode()
    store.set(f"answer{env.rank}", admission.answer(token, challenge, env.rank))
    if env.rank == 0:
        store.wait([f"answer{r}" for r in range(env.world_size)], timedelta(seconds=timeout_s))
        answers = {r: store.get(f"answer{r}").decode() for r in range(env.world_size)}
        store.set("verdict", json.dumps(admission.refused(token, challenge, answers)))
    store.wait(["verdict"], timedelta(seconds=timeout_s))
    refused = {int(r): why for r, why in json.loads(store.get("verdict")).items()}
    if not refused:
        return
    _until_all_have_read(store, env)
    raise PreflightError(refusal_message(refused, _present(store, env.world_size), env))


def refusal_message(refused: dict[int, str], present: dict[int, dict], env: WorkerEnv) -> str:
    """What node 0 says of the nodes it refused, and what a refused node says of itself."""
    nodes = {present[r]["node"]: (present[r]["host"], why) for r, why in sorted(refused.items())}
    if env.group_rank in nodes:
        why = nodes[env.group_rank][1]
        return (f"node 0 refused this node {env.group_rank}: {why}. Start it with "
                f"the cluster.token=... that node 0's plan shows (or give every node the same cluster.token)")
    lines = ["refused node(s) that do not hold this job's cluster.token (no rank of the job was admitted):"]
    lines += [f"  node {node} (host {host}): {why}" for node, (host, why) in sorted(nodes.items())]
    return "\n".join(lines)


def _reachable(store: dist.Store, present: dict[int, dict], env: WorkerEnv, master_addr: str, timeout_s: float) -> None:
    """Every node's advertised address must be reachable from the others: loopback never is, the rest is tried."""
    if is_loopback(master_addr):
        return  # every node on this machine: loopback reaches them all
    bad = {info["node"]: info for info in present.values() if info.get("addr") and is_loopback(info["addr"])}
    if not bad:
        nodes = env.world_size // env.local_world_size
        if env.local_rank == 0:
            found = reach.probe(store, env.group_rank, nodes, present[env.rank].get("addr"), timeout_s)
        else:
            found = reach.unreachable(store, nodes, timeout_s)
        if found:
            _until_all_have_read(store, env)
            raise PreflightError(reach.message(found, present, master_addr))
        return
    lines = ["the collectives of these nodes advertise a loopback address, which their peers on other machines cannot reach:"]
    for node, info in sorted(bad.items()):
        lines.append(f"  node {node} (host {info['host']}): {info['addr']}, {info['how']}; set {info['variable']} on node "
                     f"{node} to the interface that reaches {master_addr} (`ip route get {master_addr}` names it)")
    lines.append("dlaunch sets GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME and TP_SOCKET_IFNAME to that interface "
                 "itself, unless they are set: unset them, or set them to it")
    raise PreflightError("\n".join(lines))


def _same_config(store: dist.Store, env: WorkerEnv, shared: dict[str, Any]) -> None:
    present = _present(store, env.world_size)
    reference = present[0]["config"]
    odd_nodes = sorted({info["node"] for info in present.values() if info["config"] != reference})
    if not odd_nodes:
        return
    base = json.loads(store.get("config-node0"))
    lines = ["the nodes were started with different configs (every node must run the same command, "
             "except cluster.node_rank):"]
    for node in odd_nodes:
        theirs = json.loads(store.get(f"config-node{node}"))
        diffs = [f"{k}: {_said(a)} on node 0, {_said(b)} on node {node}" for k, a, b in _chosen_first(_differences(base, theirs))]
        lines.append(f"  node {node}: " + "\n    ".join(diffs))
    _until_all_have_read(store, env)
    raise PreflightError("\n".join(lines))


def _until_all_have_read(store: dist.Store, env: WorkerEnv, timeout_s: float = 10) -> None:
    """Every rank raises, and node 0's store goes with its ranks: no rank leaves before all have read the configs."""
    try:
        store.set(f"read{env.rank}", "1")
        store.wait([f"read{r}" for r in range(env.world_size)], timedelta(seconds=timeout_s))
    except RuntimeError:  # a rank gone already (it had read what it needed), or node 0's store with it
        pass


_UNSET = object()  # a key one node's config has and the other's has not (its default applies there)


def _differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """The keys whose values differ, down to the leaves: a section one node set and the other left to its defaults
    (a recipe without a YAML holds only what its command gave) compares key by key, not as a dict against None."""
    a_dict, b_dict = isinstance(a, dict), isinstance(b, dict)
    if (a_dict or a is _UNSET) and (b_dict or b is _UNSET) and (a_dict or b_dict):
        a, b = a if a_dict else {}, b if b_dict else {}
        out = []
        for key in sorted(set(a) | set(b)):
            out += _differences(a.get(key, _UNSET), b.get(key, _UNSET), f"{prefix}{key}.")
        return out
    return [] if a == b else [(prefix.rstrip("."), a, b)]


def _chosen_first(found: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """A section's choice (``strategy.name``, ``recipe.name``) before its keys; where the choice differs, the keys
    that differ under it follow from it and are left out (each strategy has its own, at their defaults)."""
    chosen = {k.rpartition(".")[0] for k, _, _ in found if k.endswith(".name") and "." in k}
    names = [d for d in found if d[0].endswith(".name") and d[0].rpartition(".")[0] in chosen]
    return names + [d for d in found if d not in names and not any(d[0].startswith(c + ".") for c in chosen)]


def _said(value: Any) -> str:
    return "not set (its default)" if value is _UNSET else repr(value)


def _all_reduce(env: WorkerEnv, device_type: str, timeout_s: float) -> None:
    one = torch.ones(1, device=process_device(env, device_type))
    work = dist.all_reduce(one, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise PreflightError(f"a one-element all-reduce across {env.world_size} ranks failed or took over {timeout_s:g} s: {exc}") from None
    if int(one.item()) != env.world_size:
        raise PreflightError(f"a one-element all-reduce of ones returned {int(one.item())}, not the world size {env.world_size}")
