"""MultiWorkerMirroredStrategy: TF_CONFIG workers started by hand, and under dlaunch."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from launcher.cluster.resolvers import SimpleClusterResolver
from launcher.launch.rendezvous import free_port
from tests.conftest import PROBE

pytestmark = pytest.mark.slow

WORKER = """
import json, sys, torch
from launcher import distribute as dl
s = dl.MultiWorkerMirroredStrategy()
r = s.cluster_resolver
_, batch = list(s.experimental_distribute_dataset([torch.arange(8), torch.arange(6)]))
full, = list(s.experimental_distribute_dataset([torch.arange(8)]))
v = s.run(lambda t: t, args=(full,))
print(json.dumps({"task": [r.task_type, r.task_id], "replicas": s.num_replicas_in_sync,
                  "sum_none": s.reduce("SUM", v, axis=None).tolist(), "sum0": int(s.reduce("SUM", v, axis=0)),
                  "mean_partial": float(s.reduce("MEAN", s.run(lambda t: t, args=(batch,)), axis=0))}))
"""


@pytest.mark.parametrize("jobs", [{"chief": 1, "worker": 1}, {"worker": 2, "ps": 1}], ids=["chief+worker", "seed"])
def test_tf_config_workers_started_by_hand_form_one_job(tmp_path, jobs):
    """The seed's cluster_resolver example is the second: TF_CONFIG with 2 workers and a ps, and task_type 'worker'."""
    cluster = {job: [f"127.0.0.1:{free_port()}" for _ in range(n)] for job, n in jobs.items()}
    training = [(job, i) for job in ("chief", "worker") for i in range(jobs.get(job, 0))]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = []
    for task in ({"type": job, "index": i} for job, i in training):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": task})
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, as meant: on a 1-GPU machine both tasks would take cuda:0 (nccl)
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        results = [json.loads(p.communicate(timeout=90)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [tuple(r["task"]) for r in results] == training
    for r in results:
        assert r["replicas"] == 2 and r["sum_none"] == [4, 6, 8, 10] and r["sum0"] == 28
        assert r["mean_partial"] == pytest.approx(15 / 6)


def test_a_lone_worker_without_tf_config_has_tf_configs_resolver_as_in_tf(monkeypatch):
    """strategy.txt: a multi-worker strategy has a ClusterResolver (the seed's `strategy.cluster_resolver.task_type`);
    with TF_CONFIG unset TF's is a TFConfigClusterResolver of an empty cluster. It was None: an AttributeError."""
    from launcher import distribute as dl

    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    strategy = dl.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    assert isinstance(resolver, dl.cluster_resolver.TFConfigClusterResolver)
    assert resolver.task_type is None and resolver.cluster_spec().as_dict() == {}
    assert strategy.num_replicas_in_sync == 1 and not torch.distributed.is_initialized()


def test_a_ps_task_is_refused():
    from launcher import distribute as dl

    resolver = SimpleClusterResolver({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, task_type="ps", task_id=0)
    with pytest.raises(ValueError, match="no ps tasks"):
        dl.MultiWorkerMirroredStrategy(resolver)


def test_a_cluster_without_this_task_is_a_value_error():
    from launcher import distribute as dl

    with pytest.raises(ValueError, match="task_type or task_id"):
        dl.MultiWorkerMirroredStrategy(SimpleClusterResolver({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}))


def test_dlaunch_multi_worker_mirrored_trains_like_one_device(run_dlaunch):
    common = ("trainer.steps=30", f"recipe.entry={PROBE}", "+recipe.save_params=true")
    proc, one = run_dlaunch("strategy=one_device", *common, name="one")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, mw = run_dlaunch("strategy=multi_worker_mirrored", "cluster=1x2", *common, name="mw")
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = (torch.load(d / "params.pt", weights_only=True) for d in (one, mw))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)



def test_in_a_dlaunch_job_a_tf_config_left_in_the_environment_is_not_the_cluster(monkeypatch, tmp_path, caplog):
    """A script that builds MultiWorkerMirroredStrategy() in a dlaunch job of one process, with a TF_CONFIG of two
    workers exported (a TF habit): dlaunch's plan stands. It read TF_CONFIG and waited 300 s for a worker never started."""
    import json

    from launcher import distribute as dl

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    tf = {"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf))
    monkeypatch.setenv("DLAUNCH_RUN_DIR", str(tmp_path))  # what dlaunch sets in a script's processes
    from launcher.distribute.context import experimental_set_strategy
    from launcher.strategies.impl.multi_worker_mirrored import default_resolver

    assert default_resolver().cluster_spec().as_dict() == tf["cluster"]  # the variable alone (a child process's)
    experimental_set_strategy(dl.OneDeviceStrategy("cpu"))  # and dlaunch's strategy set, as it runs a script
    try:
        with caplog.at_level(logging.WARNING, logger="dlaunch"):
            strategy = dl.MultiWorkerMirroredStrategy()
    finally:
        experimental_set_strategy(None)
    assert strategy.num_replicas_in_sync == 1 and not torch.distributed.is_initialized()
    assert strategy.cluster_resolver.cluster_spec().as_dict() == {}
    assert ("TF_CONFIG lists 2 tasks, but this process runs in a dlaunch job (1 process(es)): dlaunch's plan stands"
            in caplog.text), caplog.text
    monkeypatch.delenv("DLAUNCH_RUN_DIR")  # outside dlaunch, TF_CONFIG is the cluster, as in TF
    assert default_resolver().cluster_spec().as_dict() == tf["cluster"]
