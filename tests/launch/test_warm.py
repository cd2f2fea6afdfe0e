"""Warm workers: the console script forks local CPU workers from a forkserver that imported them early."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launcher.config import compose as composer
from launcher.launch import warm
from tests.conftest import PROBE, alive, command, dlaunch, process_state, summary

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the forkserver is used on Linux")


@pytest.mark.parametrize("argv", [
    ["--help"], ["--cfg", "job"], ["launch.dry_run=true"], ["launch.warm_workers=false"],
    ["recipes", "ls"], ["report", "x"], ["hydra/launcher=submitit_slurm"], ["-m", "cluster=1x2,1x4", "hydra/launcher=joblib"],
    ["-m", "recipe=linear,charlm", "trainer.steps=5,10"],  # a sweep whose every job is one process
    # one process, which trains in dlaunch: dlaunch's own config is 1x1 and no shipped recipe sets a shape
    ["trainer.steps=5"], ["recipe=charlm", "strategy=mirrored", "cluster.device=cpu"], ["cluster=1x1"],
])
def test_command_lines_that_start_no_workers_start_no_server(argv):
    assert not warm.start_early(argv)
    assert not warm.started()


@linux_only
def test_a_job_without_local_cpu_processes_stops_the_early_server():
    argv = ["strategy=multi_worker_mirrored", "cluster=2x2", "cluster.node_rank=1", "cluster.master_port=29500"]
    assert warm.start_early(argv)
    try:
        pid = __import__("multiprocessing.forkserver").forkserver._forkserver._forkserver_pid
        assert warm.started() and pid is not None
        spec = composer.compose_and_validate(argv, cuda_devices=0)  # one node of two machines: its workers start fresh
        assert not warm.eligible(spec, 0)
        assert not warm.keep_if_useful(spec, 0)
        assert not warm.started()
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # stopped and reaped
    finally:
        warm.stop()


@linux_only
def test_agents_fork_only_from_a_server_whose_torch_loaded_as_a_fresh_agents_would(monkeypatch):
    """Emulated nodes: dlaunch quiets torch's C++ store warnings before torch loads (TORCH_CPP_LOG_LEVEL, read as it
    loads). The server started by a command line of several nodes loads it so too; one that did not, or a TORCH*
    variable set since, means fresh agents: forked ones printed the C++ warnings that fresh ones do not."""
    monkeypatch.setattr(warm, "_kept", False)
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    argv = ["strategy=multi_worker_mirrored", "cluster=2x1"]
    assert warm.several_nodes(argv) and warm.several_nodes(["+cluster.nodes=3"]) and not warm.several_nodes(["cluster=1x4"])
    assert warm.start_early(argv)
    try:
        assert warm.keep_if_useful(composer.compose_and_validate(argv, cuda_devices=0), 0)
        assert not warm.forks_agents()  # a fresh agent now would print C++ warnings
        monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")  # what dlaunch's env.quiet_cpp_warnings() sets
        assert warm.forks_agents()
        monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")
        assert not warm.forks_agents()
    finally:
        warm.stop()


@linux_only
@pytest.mark.parametrize("argv, guess", [(["strategy=mirrored", "cluster=2x2", "cluster.nodes=1"], True),
                                         (["strategy=mirrored", "cluster=tasks"], False)],
                         ids=["guessed several nodes, validated one", "guessed one, validated several"])
def test_a_server_whose_torch_loaded_otherwise_than_the_job_needs_is_stopped(monkeypatch, argv, guess):
    """The command line's guess (``several_nodes``) against the validated job: a 1x2 job's warm workers must not
    fork from a server whose torch hides C++ warnings, nor emulated nodes' agents from one that shows them."""
    monkeypatch.setattr(warm, "_kept", False)
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    assert warm.several_nodes(argv)  # the first guess is wrong as it stands; the second one is forced wrong
    monkeypatch.setattr(warm, "several_nodes", lambda argv: guess)
    assert warm.start_early(argv)
    try:
        spec = composer.compose_and_validate(argv, cuda_devices=0)
        assert warm.eligible(spec, 0)
        assert not warm.keep_if_useful(spec, 0) and not warm.started()
    finally:
        warm.stop()


@linux_only
@pytest.mark.parametrize("kept", [False, True], ids=["no job kept it", "its workers have ended"])
def test_the_server_is_killed_at_the_end_not_waited_for(monkeypatch, kept):
    # no job kept it (a config error: main() returns before keep_if_useful): it may still be importing torch;
    # a job's workers forked from it and have all ended: its own exit would shut down an interpreter with torch
    # imported, seconds after a stop on a busy machine
    assert warm.start_early(["cluster=1x2", "trainer.steps=-1"])
    pid = __import__("multiprocessing.forkserver").forkserver._forkserver._forkserver_pid
    monkeypatch.setattr(warm, "_kept", kept)

    def no_waiting(seconds):
        raise AssertionError("shutdown waited for a server with no worker")

    monkeypatch.setattr(warm.time, "sleep", no_waiting)
    warm.shutdown()
    assert not warm.started()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # killed and reaped at once


@pytest.mark.parametrize("argv", [
    ["cluster=1x2"], ["cluster=2x1"], ["cluster=tasks"], ["cluster.devices_per_node=4"], ["+cluster.nodes=2"],
    ["--config-dir", "mine"], ["--config-name=other"], ["recipe=mine.yaml"], ["recipe=path/to/mine.py"],
    ["strategy=parameter_server"], ["-m", "cluster=1x1,1x2"], ["-m", "strategy=one_device,parameter_server"],
    ["-m", "recipe=linear,mine.yaml"],
])
def test_a_command_line_that_may_ask_for_workers_warms_them(argv):
    """Another primary config, a user's recipe (its YAML may set the shape), a shape of more than one device, or
    parameter-server tasks (their agents fork from the server)."""
    assert warm.may_ask_for_workers(argv)


@linux_only
def test_a_sweep_keeps_the_server_for_the_jobs_that_can_fork_from_it(monkeypatch):
    """Each job of a sweep run here asks as it starts (``fits``): a 1x2 job forks its workers from the server, a
    one-process job trains in dlaunch and a CUDA one starts fresh workers; a sweep with no such job stops it."""
    monkeypatch.setattr(warm, "_kept", False)
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    argv = ["-m", "strategy=mirrored", "cluster=1x1,1x2"]
    assert not warm.several_nodes(argv) and warm.several_nodes(["-m", "cluster=1x2,2x1"])
    one, two = (composer.compose_and_validate(["strategy=mirrored", f"cluster={shape}"], cuda_devices=0)
                for shape in ("1x1", "1x2"))
    assert warm.start_early(argv)
    try:
        assert warm.keep_for_sweep([one, two], 0, undecided=False) and warm.started()
        assert warm.fits(two, 0) and warm.serves()
        assert not warm.fits(one, 0) and not warm.serves() and warm.started()  # kept for the jobs after it
        assert not warm.fits(two, 1) and not warm.serves()  # the same job on a GPU machine
        assert warm.fits(two, 0) and warm.serves()
        threads = os.environ.get("OMP_NUM_THREADS", "1")
        monkeypatch.setenv("OMP_NUM_THREADS", str(int(threads) + 2))  # a job's hydra.job.env_set: read as torch loads
        assert not warm.fits(two, 0) and not warm.serves()
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        assert not warm.keep_for_sweep([one], 0, undecided=False) and not warm.started() and not warm.serves()
    finally:
        warm.stop()
    assert warm.start_early(argv)
    try:
        assert warm.keep_for_sweep([one], 0, undecided=True), "a job validated only as it runs may use it"
    finally:
        warm.stop()


@linux_only
def test_resume_warms_up_as_the_runs_own_command_did_where_the_console_script_runs_it(monkeypatch):
    """``dlaunch resume DIR``: the command line the console script sees names no shape; the run's own, read from
    its directory, does. ``main(["resume", ...])`` called in another program starts no server, as ``main()`` does not."""
    monkeypatch.setattr(warm, "_resume_may_warm", False)
    run = ["strategy=mirrored", "cluster=1x2", "trainer.steps=4"]
    assert not warm.start_for_resume(run) and not warm.started()
    assert not warm.start_early(["resume", "outputs/run"]) and not warm.started()  # what the console script sees
    try:
        assert warm.start_for_resume(run) and warm.started()
    finally:
        warm.stop()


def test_eligibility_follows_the_validated_job():
    mirrored = composer.compose_and_validate(["strategy=mirrored", "cluster=1x2"], cuda_devices=0)
    assert warm.eligible(mirrored, 0) == (sys.platform == "linux")
    off = composer.compose_and_validate(["strategy=mirrored", "cluster=1x2", "launch.warm_workers=false"], cuda_devices=0)
    assert not warm.eligible(off, 0)
    # agents fork from it: emulated nodes', parameter-server tasks'
    emulated = composer.compose_and_validate(["strategy=multi_worker_mirrored", "cluster=2x1"], cuda_devices=0)
    tasks = composer.compose_and_validate(["recipe=wide_deep", "strategy=parameter_server", "cluster.ps=1"], cuda_devices=0)
    assert warm.eligible(emulated, 0) == warm.eligible(tasks, 0) == (sys.platform == "linux")
    node = composer.compose_and_validate(["strategy=multi_worker_mirrored", "cluster=2x2", "cluster.node_rank=1",
                                          "cluster.master_port=29500"], cuda_devices=0)
    on_gpus = composer.compose_and_validate(["strategy=multi_worker_mirrored", "cluster=2x1"], cuda_devices=2)
    assert not warm.eligible(node, 0) and not warm.eligible(on_gpus, 2)


@linux_only
@pytest.mark.slow
def test_workers_fork_from_the_warm_server_and_train_as_fresh_interpreters_do(tmp_path):
    runs = {}
    for warm_workers in ("true", "false"):
        out = tmp_path / warm_workers
        # DataLoader workers too: a forked worker's default start method was the server's (forkserver), and its
        # loader failed to pickle the collate function.
        done = dlaunch("recipe=linear", "strategy=mirrored", "cluster=1x2", "trainer.steps=6", "input.num_workers=2",
                       f"launch.warm_workers={warm_workers}", f"hydra.run.dir={out}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("forked from a process that imported torch" in done.stdout + done.stderr) == (warm_workers == "true")
        runs[warm_workers] = summary(out)
        servers = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout.splitlines()
        assert [s for s in servers if "multiprocessing.forkserver" in s and str(tmp_path) in s] == [], "reaped at exit"
    assert runs["true"]["final_loss"] == runs["false"]["final_loss"]


@linux_only
@pytest.mark.slow
def test_a_sweeps_jobs_fork_their_workers_and_agents_from_one_server(tmp_path):
    """``dlaunch -m``: the jobs run one after the other in dlaunch, and each job of several processes forks them
    (its workers, or its emulated nodes' agents) from the one warm server; they train as the one-process job does, in
    the environment a fresh one would have (Hydra sets a job's ``hydra.job.env_set`` after the server started).
    ``test_workers_fork_from_the_warm_server_and_train_as_fresh_interpreters_do`` compares forked with fresh."""
    done = dlaunch("-m", "strategy=multi_worker_mirrored", "cluster=1x1,1x2,2x1", "trainer.steps=4", f"recipe.entry={PROBE}",
                   "+recipe.record_env=true", "+hydra.job.env_set.DLAUNCH_TEST_PROBE=set", f"hydra.sweep.dir={tmp_path}",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [(tmp_path / str(job) / "dlaunch.log").read_text() for job in range(3)]
    assert ["forked from a process that imported torch" in log for log in logs] == [False, True, True], logs
    results = [summary(tmp_path / str(job)) for job in range(3)]
    assert [r["status"] for r in results] == ["completed"] * 3
    assert [r["final_loss"] for r in results] == pytest.approx([results[0]["final_loss"]] * 3, rel=1e-5)
    for job in (1, 2):
        seen = [json.loads(f.read_text())["probe"] for f in sorted((tmp_path / str(job)).glob("env-rank*.json"))]
        assert seen == ["set", "set"], (job, seen)
        for progress in (tmp_path / str(job) / ".dlaunch").glob("rank-*.progress.json"):
            with pytest.raises(ProcessLookupError):
                os.kill(json.loads(progress.read_text())["pid"], 0)  # the forked workers are gone with dlaunch


@linux_only
@pytest.mark.slow
def test_a_failing_forked_worker_is_restarted_then_reported_once_and_nothing_is_left(tmp_path):
    run_dir = tmp_path / "run"
    done = dlaunch("strategy=mirrored", "cluster=1x2", f"recipe.entry={PROBE}", "recipe.examples=640", "trainer.steps=30",
                   "+recipe.fail_replica=1", "+recipe.fail_step=3", "+recipe.record_attempts=true", "launch.max_restarts=1",
                   f"hydra.run.dir={run_dir}", cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "forked from a process that imported torch" in out
    assert len((run_dir / "attempts-rank1.txt").read_text().split()) == 2, "tried, then restarted once"
    assert out.count("root cause") == 1 and "injected failure on replica 1 at step 3" in out
    assert summary(run_dir)["status"] == "failed"
    for progress in (run_dir / ".dlaunch").glob("rank-*.progress.json"):
        pid = json.loads(progress.read_text())["pid"]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the forked workers are gone with dlaunch


@linux_only
@pytest.mark.slow
@pytest.mark.parametrize("job", [("strategy=mirrored", "cluster=1x2"), ("strategy=multi_worker_mirrored", "cluster=2x1")],
                         ids=["forked workers", "forked node agents"])
def test_killing_dlaunch_takes_what_it_forked_and_the_server_with_it(tmp_path, job):
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command(*job, "trainer.steps=1000000", "trainer.log_every=50", f"hydra.run.dir={run_dir}"),
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while len(list((run_dir / ".dlaunch").glob("rank-*.progress.json"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [json.loads(p.read_text())["pid"] for p in (run_dir / ".dlaunch").glob("rank-*.progress.json")]
        assert len(pids) == 2, "the workers should be training"
        # each worker and what it descends from below dlaunch: the server, and a node's agent and its own server
        left = set()
        for pid in pids:
            while pid not in (proc.pid, 0, 1):  # up to dlaunch (0, 1: gone, or orphaned already)
                left.add(pid)
                pid = (process_state(pid) or ("", 0, 0))[1]
        assert len(left) == (3 if job[1] == "cluster=1x2" else 7)  # two workers, (two agents, theirs,) one server
        proc.send_signal(signal.SIGKILL)  # no handler runs: only the kernel's parent-death signals are left
        proc.wait()
        deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:
            left = {pid for pid in left if alive(pid)}
            time.sleep(0.1)
        assert left == set(), "orphans: forked workers, agents or their forkserver outlived dlaunch"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_ctrl_c_while_the_server_imports_ends_it_quietly_and_its_workers_keep_pythons_default():
    """The guard's SIGINT handler: the server (still importing torch) exits 130 without a traceback; a process it
    forks gets KeyboardInterrupt, as from Python's own handler."""
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "import launcher.launch.forkserver_guard\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    try:\n"
            "        os.kill(os.getpid(), signal.SIGINT); time.sleep(1)\n"
            "    except KeyboardInterrupt:\n"
            "        os._exit(7)\n"
            "    os._exit(0)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "print('child', os.waitstatus_to_exitcode(status), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
            "print('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "child 7\n", "")


@linux_only
def test_a_ctrl_c_as_the_server_starts_waits_for_the_guard_and_ends_it_quietly():
    """SIGINT sent the moment the server's interpreter exists (a Ctrl-C in dlaunch's first second on a busy
    machine): held back until the guard handles it, not a ``Fatal Python error`` from the start-up, nor a kill."""
    code = ("import os, signal\n"
            "from multiprocessing import forkserver\n"
            "from launcher.launch import warm\n"
            "warm._launch()\n"
            "pid = forkserver._forkserver._forkserver_pid\n"
            "os.kill(pid, signal.SIGINT)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "print('server', os.waitstatus_to_exitcode(status), signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "server 130 set()\n", ""), proc.stderr[-3000:]
