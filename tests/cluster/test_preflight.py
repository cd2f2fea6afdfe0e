"""The preflight: a rank that never joins is named quickly; a working job passes it."""

from __future__ import annotations

import time

import pytest

from launcher.cluster.env import WorkerEnv
from launcher.cluster.preflight import missing_ranks_message
from launcher.launch.function import WorkerFailed, run_function

SPEC = {"trainer": {"steps": 10}, "cluster": {"nodes": 1, "node_rank": None}}


def rank_1_is_late(delay_s: float, timeout_s: float) -> int:
    from launcher.cluster import preflight

    env = WorkerEnv.from_environ()
    if env.rank == 1:
        time.sleep(delay_s)
    preflight.check(env, SPEC, timeout_s, "gloo", "cpu")
    return env.world_size


@pytest.mark.slow
def test_every_rank_present_passes_and_all_reduces():
    assert run_function(rank_1_is_late, device="cpu", nproc=2, args=(0.0, 20.0)) == {0: 2, 1: 2}


@pytest.mark.slow
def test_a_rank_that_never_joins_is_named_before_it_would_have_joined():
    """Rank 1 would join after 120 s; the 3 s preflight names it long before. Two process starts and two torch
    imports took 31 s on a loaded CI machine, so the bound is the late rank's delay, not a timing claim."""
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        run_function(rank_1_is_late, device="cpu", nproc=2, args=(120.0, 3.0))
    assert time.monotonic() - start < 100
    root = info.value.root
    assert root.rank == 0 and "PreflightError" in root.exception
    assert "1 of 2 ranks joined within 3 s" in root.exception
    assert "node 0: rank(s) 1 (local rank 1; on host" in root.exception


def test_missing_whole_node_message():
    env = WorkerEnv(rank=0, local_rank=0, world_size=6, local_world_size=2, group_rank=0, master_addr="10.0.0.1", master_port=29500)
    present = {r: {"host": f"h{r // 2}", "node": r // 2} for r in (0, 1, 3)}
    text = missing_ranks_message(present, env, 30)
    assert "3 of 6 ranks joined within 30 s" in text
    assert "node 1: rank(s) 2 (local rank 0; on host h1)" in text
    assert "node 2: rank(s) 4, 5 (local rank 0, 1; no rank of this node joined)" in text
    assert "10.0.0.1:29500" in text


def test_a_rank_that_announces_itself_as_the_wait_gives_up_has_joined():
    """Seen on a loaded machine: "2 of 2 ranks joined within 60 s; missing:" and nothing missing, a failed run.
    The store's wait gave up, and the last rank's key was there by the time the ranks were listed."""
    import torch.distributed as dist

    from launcher.cluster import preflight

    class LastKeyLandsAsTheWaitGivesUp(dist.Store):
        def __init__(self):
            super().__init__()
            self.inner = dist.HashStore()

        def set(self, key, value):
            self.inner.set(key, value)

        def get(self, key):
            return self.inner.get(key)

        def check(self, keys):
            return self.inner.check(keys)

        def wait(self, keys, timeout=None):
            raise RuntimeError("Wait timeout")

    env = WorkerEnv(rank=0, local_rank=0, world_size=2, local_world_size=2, group_rank=0, master_addr="127.0.0.1", master_port=1)
    store = LastKeyLandsAsTheWaitGivesUp()
    for r in range(2):
        store.set(f"rank{r}", '{"host": "h", "node": 0}')
    preflight._wait_for_all(store, env, 0.1)  # returns: both ranks are here
    store.inner.delete_key("rank1")
    with pytest.raises(preflight.PreflightError, match="1 of 2 ranks joined"):
        preflight._wait_for_all(store, env, 0.1)


def test_a_setting_only_one_node_gave_is_named_key_by_key_not_as_a_section_against_none():
    """A recipe without a YAML: node 1's `recipe.optimizer.lr=0.01` was said as `recipe.optimizer: None on node 0,
    {'lr': 0.01} on node 1`; node 0's optimizer is not None, it is the recipe's default."""
    from launcher.cluster import preflight

    base = {"recipe": {"name": "slow"}, "trainer": {"steps": 100}}
    theirs = {"recipe": {"name": "slow", "optimizer": {"lr": 0.01}}, "trainer": {"steps": 60}}
    found = {k: (preflight._said(a), preflight._said(b)) for k, a, b in preflight._differences(base, theirs)}
    assert found == {"recipe.optimizer.lr": ("not set (its default)", "0.01"), "trainer.steps": ("100", "60")}
    assert preflight._differences({"a": None}, {"a": {"b": 1}}) == [("a", None, {"b": 1})]  # a null is a value


def test_nodes_whose_auto_device_resolved_differently_are_told_before_the_group_forms():
    """Node 0 has GPUs (auto: cuda, nccl), node 1 none (auto: cpu, gloo), same command: the process group of nccl
    and gloo ranks would never form. Each node announces what it resolved; the difference is named."""
    import torch.distributed as dist

    from launcher.cluster import preflight

    store, spec = dist.HashStore(), {"trainer": {"steps": 10}, "cluster": {"nodes": 2, "node_rank": None, "device": "auto"}}
    envs = [WorkerEnv(rank=r, local_rank=0, world_size=2, local_world_size=1, group_rank=r, master_addr="10.0.0.1",
                      master_port=29500) for r in (0, 1)]
    shared = [preflight._shared_part(spec, "nccl", "cuda"), preflight._shared_part(spec, "gloo", "cpu")]
    for env, mine in zip(envs, shared):
        preflight._announce(store, env, mine, "gloo")
    store.set("read1", "1")  # node 1 has read the configs too
    with pytest.raises(preflight.PreflightError) as info:
        preflight._same_config(store, envs[0], shared[0])
    text = str(info.value)
    assert "device: 'cuda' on node 0, 'cpu' on node 1" in text and "backend: 'nccl' on node 0, 'gloo' on node 1" in text
    assert "cluster.device/backend=auto" in text


def test_a_strategy_that_differs_is_named_first_without_the_keys_that_follow_from_it():
    """mirrored on node 0, fsdp on node 1: the difference came sixth on one long line, after each strategy's keys at
    their defaults (bucket_cap_mb on node 0, not set on node 1, ...)."""
    from launcher.cluster import preflight

    base = {"strategy": {"name": "mirrored", "bucket_cap_mb": 25}, "trainer": {"steps": 10}}
    theirs = {"strategy": {"name": "fsdp", "wrap": []}, "trainer": {"steps": 12}}
    found = [k for k, _, _ in preflight._chosen_first(preflight._differences(base, theirs))]
    assert found == ["strategy.name", "trainer.steps"]
