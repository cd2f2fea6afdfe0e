"""strategy=parameter_server end to end: real chief, worker and ps processes over torch.distributed.rpc.

Each test runs ``dlaunch`` as a user would, with the probe recipe of
``tests/fixtures/ps_recipe.py`` (an embedding table, a dense layer, probes that
kill a task or measure memory) or the shipped ``wide_deep`` recipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch

from launcher.checkpoint import layout, read_tensors
from launcher.launch.rendezvous import free_port
from launcher.runtime.outputs import read_records
from tests.conftest import FIXTURES, command, summary
from tests.launch.test_restarts import STARTUP_S, run_processes

pytestmark = pytest.mark.slow
RECIPE = ("recipe.name=ps_probe", f"recipe.entry={FIXTURES / 'ps_recipe.py'}", "recipe.strategies=[one_device,parameter_server]")
PS = ("strategy=parameter_server", "cluster.workers=1", "cluster.ps=2")


def ps_run(run_dlaunch, *args: str, name: str = "run", timeout: float = 240):
    return run_dlaunch(*RECIPE, *PS, *args, name=name, timeout=timeout)


def test_wide_deep_trains_asynchronously_on_two_workers_and_two_ps(run_dlaunch):
    """The issue's command: the loss clearly falls, the held-out AUC is the one-device recipe's, the table is split."""
    proc, run_dir = run_dlaunch("recipe=wide_deep", "strategy=parameter_server", "cluster.workers=2", "cluster.ps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(run_dir)
    assert s["final_loss"] < 0.85 * s["first_loss"], s
    assert s["metrics"]["eval_auc"] > 0.75, s["metrics"]
    assert s["world_size"] == 5
    out = proc.stdout + proc.stderr
    assert "variable placement" in out
    assert "deep_embedding.weight" in out and "1/2 rows 0-49999" in out and "2/2 rows 50000-99999" in out
    assert "agent (forked from a process that imported torch" in out  # the five agents: not fresh interpreters


def test_sync_mode_equals_one_device_and_its_checkpoint_resumes_there(run_dlaunch):
    """One gradient per task per step (SyncReplicasOptimizer) is one device's step on the global batch."""
    common = ("trainer.steps=20", "+recipe.save_params=true")
    proc, ps_dir = ps_run(run_dlaunch, *common, "strategy.mode=sync", "trainer.checkpoint.every_steps=10",
                          "strategy.partitioner.kind=fixed", "strategy.partitioner.num_shards=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, one_dir = run_dlaunch(*RECIPE, *common, name="one")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ps_params, one_params = torch.load(ps_dir / "params.pt"), torch.load(one_dir / "params.pt")
    assert set(ps_params) == set(one_params) == {"table.weight", "dense.weight", "dense.bias", "head.weight", "head.bias"}
    for name, value in one_params.items():
        torch.testing.assert_close(ps_params[name], value, rtol=1e-5, atol=1e-6, msg=name)

    # A resume from step 10 ends where the uninterrupted run did, however late the ps tasks build their variables
    # (a load they overwrote with fresh ones went on from step 10 with the model of step 0, and said nothing).
    proc, again = ps_run(run_dlaunch, *common, "strategy.mode=sync", "strategy.partitioner.kind=fixed",
                         "strategy.partitioner.num_shards=3", "+recipe.ps_build_sleep=3",
                         f"trainer.resume={layout.step_dir(ps_dir / 'checkpoints', 10)}", name="again")
    assert proc.returncode == 0 and summary(again)["resumed_from_step"] == 10, proc.stderr[-3000:]
    for name, value in torch.load(again / "params.pt").items():
        torch.testing.assert_close(value, ps_params[name], rtol=1e-6, atol=1e-7, msg=name)

    # The ps tasks wrote the table as 3 chunks of one variable: it reads back whole, and a one_device run resumes from it.
    final = layout.step_dir(ps_dir / "checkpoints", 20)
    saved = read_tensors(final)
    for name, value in ps_params.items():
        assert torch.equal(saved[name], value), name
    proc, resumed = run_dlaunch(*RECIPE, "trainer.steps=21", f"trainer.resume={final}", name="resumed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(resumed)["resumed_from_step"] == 20
    assert "resumed from" in proc.stdout + proc.stderr and "step 20" in proc.stdout + proc.stderr


def test_a_killed_worker_does_not_stop_the_job(run_dlaunch):
    proc, run_dir = ps_run(run_dlaunch, "cluster.workers=2", "input.global_batch_size=66", "trainer.steps=40",
                           "+recipe.kill_task=worker:1", "+recipe.kill_step=4", "+recipe.step_sleep=0.05",
                           "recipe.optimizer.momentum=0", "trainer.log_every=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(run_dir)
    assert s["status"] == "completed" and s["steps"] == 40
    # the job trained on: asynchronous updates make one batch's loss noisy (2.03 at step 40 once on a loaded CI
    # machine with momentum 0.9), so the last five records' mean is compared, without momentum to amplify staleness
    losses = [r["loss"] for r in read_records(run_dir / "metrics.jsonl") if "loss" in r]
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0], losses
    assert "worker:1 had failed (signal SIGKILL); the job went on without it" in " ".join((proc.stdout + proc.stderr).split())
    assert not run_processes(run_dir)


def test_a_dead_ps_is_named_within_the_rpc_timeout(run_dlaunch):
    rpc_timeout = 10
    proc, run_dir = ps_run(run_dlaunch, "trainer.steps=400", f"strategy.rpc_timeout_s={rpc_timeout}",
                           "+recipe.kill_task=ps:1", "+recipe.kill_step=6", "+recipe.step_sleep=0.02")
    ended = time.time()
    assert proc.returncode == 1, proc.stderr[-3000:]
    killed = float((run_dir / "ps-killed-at.txt").read_text())
    # the 10 s timeout, then 4 agents' teardown (18 s in all measured on a loaded 2-core machine): well under
    # torch's 60 s default, which would mean strategy.rpc_timeout_s was not applied
    assert ended - killed < rpc_timeout + 30
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "parameter server ps:1 unavailable" in text
    assert "task ps:1 failed: root cause" in text and "signal SIGKILL" in text
    assert summary(run_dir)["status"] == "failed"
    assert not run_processes(run_dir)


def restarted_once(run_dlaunch, steps: int, *kill: str):
    """A job of ``steps`` steps, checkpointed every 5, whose ``kill`` probe ends a task once: it restarts and completes."""
    # two starts of four tasks in one command: 114 s alone on a busy day, past 240 s under five test streams and a hog
    proc, run_dir = ps_run(run_dlaunch, f"trainer.steps={steps}", "trainer.checkpoint.every_steps=5",
                           "launch.max_restarts=1", *kill, "+recipe.step_sleep=0.03", timeout=2 * STARTUP_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "restarting every task from the newest checkpoint (restart 1 of 1)" in text
    return text, run_dir


def test_a_dead_ps_restarts_the_job_from_the_last_checkpoint(run_dlaunch):
    text, run_dir = restarted_once(run_dlaunch, 30, "+recipe.kill_task=ps:1", "+recipe.kill_step=12",
                                   "+recipe.kill_after_checkpoint=true")
    assert "ps:1 unavailable" in text and "ps:0 unavailable" not in text, "ps:0 was stopped by dlaunch, not lost"
    s = summary(run_dir)
    assert s["status"] == "completed" and s["restarts"] == 0
    # ps:1 dies after 12 updates (the chief's and the worker's) and the first checkpoint; a busy machine may let the
    # chief run on: the run resumed from a checkpoint taken before the end, not from the start
    assert s["resumed_from_step"] in (5, 10, 15, 20, 25), s["resumed_from_step"]
    assert layout.latest(run_dir / "checkpoints").name == "step-00000030"


def test_a_partitioned_million_row_table_never_lands_on_a_worker(run_dlaunch):
    """1,000,000 x 64 floats (256 MB) on 2 ps: the chief and the worker pull only the rows their batches name."""
    proc, run_dir = ps_run(run_dlaunch, "+recipe.num_ids=1000000", "+recipe.dim=64", "+recipe.record_memory=true",
                           "trainer.steps=10", "recipe.optimizer.name=adagrad", "recipe.optimizer.momentum=0.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table_mib = 1_000_000 * 64 * 4 / 2**20
    memory = {json.loads(p.read_text())["task"]: json.loads(p.read_text()) for p in run_dir.glob("memory-*.json")}
    for task in ("chief:0", "worker:0"):
        grew = memory[task]["peak_rss_mib"] - memory[task]["rss_before_mib"]
        assert grew < table_mib / 4, (task, grew, table_mib)
    for task in ("ps:0", "ps:1"):  # each ps built the table (to start from one device's values) and keeps half
        assert memory[task]["peak_rss_mib"] - memory[task]["rss_before_mib"] > table_mib / 2
    assert "table.weight" in proc.stdout + proc.stderr and "1/2 rows 0-499999" in proc.stdout + proc.stderr


def test_each_task_can_run_its_own_dlaunch_as_on_separate_machines(tmp_path):
    """cluster=tasks with cluster.task: four dlaunch commands, one per task, meeting at the chief's address."""
    port = free_port()
    tasks = f'{{chief: ["127.0.0.1:{port}"], worker: ["127.0.0.1:2223"], ps: ["127.0.0.1:2224", "127.0.0.1:2225"]}}'
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    procs = {
        name: subprocess.Popen(
            command(*RECIPE, "strategy=parameter_server", "cluster=tasks", f"cluster.tasks={tasks}",
                    f"cluster.task={{type: {kind}, index: {index}}}", "trainer.steps=20", f"hydra.run.dir={tmp_path / name}",
                    warm=False),
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for name, kind, index in (("chief", "chief", 0), ("worker", "worker", 0), ("ps0", "ps", 0), ("ps1", "ps", 1))
    }
    outputs = {name: proc.communicate(timeout=240)[0] for name, proc in procs.items()}
    assert all(proc.returncode == 0 for proc in procs.values()), outputs
    assert summary(tmp_path / "chief")["steps"] == 20
    assert "starting ps:1 here (the other tasks run elsewhere)" in " ".join(outputs["ps1"].split())
    assert "ps:1 done; the chief (127.0.0.1) wrote the results" in " ".join(outputs["ps1"].split())


@pytest.mark.timeout(900)  # two parameter-server commands of 9 processes each: past 300 s on a slow day
def test_sigterm_saves_from_the_ps_tasks_then_the_same_command_resumes(tmp_path):
    """Preemption: every task gets the signal; the ps tasks serve on until the chief has saved, then all stop.
    (test_each_task_can_run_its_own_dlaunch_as_on_separate_machines starts fresh agents.)"""
    from tests.launch.test_restarts import logged_steps

    run_dir = tmp_path / "run"
    args = command(*RECIPE, *PS, "trainer.steps=60", "trainer.log_every=1", "trainer.checkpoint.every_steps=50",
                   f"hydra.run.dir={run_dir}")  # the console script's path: agents forked from its warm server
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    proc = subprocess.Popen([*args, "+recipe.step_sleep=0.1"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    deadline = time.time() + 180
    while not [s for s in logged_steps(run_dir) if s >= 5] and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(15)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143 and "stopped by SIGTERM; every task was shut down" in out, out[-3000:]
    saved = layout.latest(run_dir / "checkpoints")
    assert saved is not None and 5 <= int(saved.name.split("-")[1]) < 60, out[-3000:]
    assert not run_processes(run_dir)

    again = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    s = summary(run_dir)
    assert s["resumed_from_step"] == int(saved.name.split("-")[1]) and s["steps"] == 60


def test_a_stop_after_the_chief_completed_exits_0_and_keeps_the_summary(tmp_path):
    """The workers and ps tasks end after the chief: a SIGTERM then exited 143 and rewrote summary.json as stopped."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command(*RECIPE, *PS, "trainer.steps=10", "+recipe.linger=30", f"hydra.run.dir={run_dir}"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while not (run_dir / "all-completed").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(15)
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode == 0 and "came in the run's last step or as its workers ended: the run completed" in out, out[-3000:]
    assert summary(run_dir)["status"] == "completed"


def test_a_killed_task_agent_is_a_root_cause_and_the_job_restarts(run_dlaunch):
    """The chief's elastic agent is SIGKILLed (so no failures file): still a named cause, and a restart."""
    text, run_dir = restarted_once(run_dlaunch, 20, "+recipe.kill_task=chief:0", "+recipe.kill_agent=true",
                                   "+recipe.kill_step=7")
    assert "task chief:0 failed (killed by signal 9: its elastic agent ended without a report" in text, text[-3000:]
    # the chief itself trains on until dlaunch sees its agent gone and stops it: on a busy machine it saved step 10
    # first (once under a CPU hog); a checkpoint taken before the end, not the start
    assert summary(run_dir)["status"] == "completed" and summary(run_dir)["resumed_from_step"] in (5, 10, 15)
    assert not run_processes(run_dir)


def test_a_worker_that_stops_before_the_chief_in_sync_mode_lets_the_chief_save(run_dlaunch):
    """worker:0 alone gets SIGTERM: it leaves after its step, and the chief's push, which waited for its gradient,
    returns; dlaunch then stops the chief, which saves, instead of hanging until the sync timeout."""
    proc, run_dir = ps_run(run_dlaunch, "cluster.ps=1", "strategy.mode=sync", "trainer.steps=400",
                           "trainer.checkpoint.every_steps=1000", "+recipe.term_task=worker:0", "+recipe.kill_step=5",
                           "+recipe.step_sleep=0.02", "launch.collective_timeout_s=120")
    assert proc.returncode == 143, proc.stderr[-3000:]
    # a stop, not a teardown: the chief is given launch.stop_grace_s to save, and says so
    assert "SIGTERM received: the ranks stop together within a step, then save" in proc.stderr, proc.stderr[-3000:]
    saved = layout.latest(run_dir / "checkpoints")
    assert saved is not None and 5 <= layout.step_of(saved) < 400, proc.stderr[-3000:]
    assert summary(run_dir)["status"] == "stopped"
    assert not run_processes(run_dir)


GRACE_S = 200  # the stop grace a save would have waited out, far above a busy machine's teardown


def test_a_worker_killed_in_sync_mode_ends_the_job_at_once_with_the_newest_checkpoint(run_dlaunch):
    """The chief's push waits for the dead worker's gradients, where a signal cannot reach its Python handler: dlaunch
    gave it launch.stop_grace_s to save all the same (30 s by default), then SIGKILLed it, while the chief and the
    ps said "SIGTERM received ... then save" and "serving on" for a save that never came. It is a teardown now."""
    proc, run_dir = ps_run(run_dlaunch, "cluster.ps=1", "strategy.mode=sync", "trainer.steps=400",
                           "trainer.checkpoint.every_steps=5", "+recipe.kill_task=worker:0", "+recipe.kill_step=12",
                           "+recipe.step_sleep=0.02", f"launch.stop_grace_s={GRACE_S}", timeout=480)
    assert proc.returncode == 1, proc.stderr[-3000:]
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "task worker:0 failed: root cause" in text and "signal SIGKILL" in text, text[-3000:]
    assert "SIGTERM received" not in text and "serving on" not in text, text[-3000:]
    saved = layout.latest(run_dir / "checkpoints")
    assert saved is not None and layout.step_of(saved) in (5, 10), text[-3000:]
    assert f"newest checkpoint: {saved}" in text, text[-3000:]
    # no wait for a save: from the error to the run's end took 45 s once under a hog and five test streams, and
    # waiting out the grace would take all of it
    assert summary(run_dir)["status"] == "failed" and time.time() - summary(run_dir)["error"]["time"] < GRACE_S * 0.75
    assert not run_processes(run_dir)
