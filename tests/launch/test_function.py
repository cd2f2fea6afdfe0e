"""``run_function``: a function on two real gloo worker processes."""

from __future__ import annotations

import ast
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from launcher.launch.function import WorkerFailed, run_function
from launcher.launch import scratch
from tests.conftest import ROOT, alive, process_state

pytestmark = pytest.mark.slow


def whoami():
    from launcher.cluster.env import WorkerEnv

    env = WorkerEnv.from_environ()
    return {"rank": env.rank, "world": env.world_size, "addr": env.master_addr}


def raises_on_rank_1():
    from launcher.cluster.env import WorkerEnv

    if WorkerEnv.from_environ().rank == 1:
        raise ValueError("rank one says no")
    return 0


def test_each_rank_returns_its_result():
    results = run_function(whoami, device="cpu", nproc=2)
    assert results == {0: {"rank": 0, "world": 2, "addr": "127.0.0.1"}, 1: {"rank": 1, "world": 2, "addr": "127.0.0.1"}}


def test_a_raising_rank_is_the_root_cause():
    with pytest.raises(WorkerFailed) as info:
        run_function(raises_on_rank_1, device="cpu", nproc=2)
    assert info.value.root.rank == 1
    assert "ValueError: rank one says no" in info.value.root.exception


def chosen_device():
    from launcher import distribute as dl

    strategy = dl.MirroredStrategy()
    return strategy.extended.worker_devices[0]


def test_the_caller_chooses_the_workers_device():
    """device="cpu" holds on a GPU machine too: two processes on one GPU would otherwise both want cuda:N."""
    assert run_function(chosen_device, device="cpu", nproc=2) == {0: "cpu:0", 1: "cpu:0"}


def where():
    import torch

    return {"server": os.getppid(), "mark": os.environ.get("DLAUNCH_TEST_MARK"), "gone": os.environ.get("DLAUNCH_TEST_GONE"),
            "cwd": os.getcwd(), "rank": os.environ["RANK"], "threads": torch.get_num_threads(),
            "local": os.environ.get("LOCAL_RANK"), "world": os.environ.get("WORLD_SIZE")}


def test_workers_fork_from_one_server_and_see_the_callers_environment_and_directory_of_each_call(monkeypatch, tmp_path):
    """As a fresh worker would: the variables and the directory of this call, not those the server started with."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("DLAUNCH_TEST_MARK", "a")
    monkeypatch.setenv("DLAUNCH_TEST_GONE", "set")
    monkeypatch.chdir(tmp_path / "a")
    first = run_function(where, device="cpu")
    monkeypatch.setenv("DLAUNCH_TEST_MARK", "b")
    monkeypatch.delenv("DLAUNCH_TEST_GONE")
    monkeypatch.chdir(tmp_path / "b")
    second = run_function(where, device="cpu")
    servers = {r["server"] for r in (*first.values(), *second.values())}
    assert len(servers) == 1 and os.getpid() not in servers  # forked, twice, from one server
    assert [(r["rank"], r["mark"], r["gone"], r["cwd"]) for r in first.values()] == [
        ("0", "a", "set", str(tmp_path / "a")), ("1", "a", "set", str(tmp_path / "a"))]
    assert [(r["rank"], r["mark"], r["gone"], r["cwd"]) for r in second.values()] == [
        ("0", "b", None, str(tmp_path / "b")), ("1", "b", None, str(tmp_path / "b"))]


def test_a_variable_torch_reads_as_it_imports_or_the_servers_death_starts_a_new_server(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = run_function(where, device="cpu")[0]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    after = run_function(where, device="cpu")[0]
    assert (before["threads"], after["threads"]) == (1, 2) and after["server"] != before["server"]
    with pytest.raises(ProcessLookupError):  # the old server was stopped and reaped
        os.kill(before["server"], 0)
    os.kill(after["server"], signal.SIGKILL)
    again = run_function(where, device="cpu")[0]
    assert again["server"] not in (after["server"], os.getpid()) and again["threads"] == 2  # warm, from a new one
    fresh = run_function(where, device="cpu", warm=False)[0]
    assert fresh["server"] == os.getpid() and fresh["threads"] == 2  # warm=False: started by this process's agent


def test_the_agents_rank_variables_win_over_the_callers_of_any_call(monkeypatch):
    """The caller had RANK=1 (a test's, say) when the server started, then RANK=7 and no LOCAL_RANK: each worker
    still gets the agent's. Before, a variable the agent set to its value at the server's start was taken from
    the caller, and rank 1 ran as rank 7."""
    monkeypatch.setenv("PYTHON_DLAUNCH_TEST_SERVER", "rank-variables")  # read at start-up (PYTHON*): a server of its own
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)
    first = run_function(where, device="cpu")
    monkeypatch.setenv("RANK", "7")
    monkeypatch.delenv("LOCAL_RANK")
    second = run_function(where, device="cpu")
    for results in (first, second):
        assert [(r["rank"], r["local"], r["world"]) for r in results.values()] == [("0", "0", "2"), ("1", "1", "2")]
    assert first[0]["server"] == second[0]["server"] != os.getpid()


def test_a_server_the_caller_forks_its_own_processes_from_is_not_killed(monkeypatch):
    """A new import-time setting needs a new server, but the caller's own processes (a DataLoader's, started with
    the forkserver method) are children of this one: it stays, and this call's workers start fresh."""
    monkeypatch.setenv("PYTHON_DLAUNCH_TEST_SERVER", "shared-1")
    before = run_function(where, device="cpu")[0]
    mine = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(600,))
    mine.start()
    try:
        monkeypatch.setenv("PYTHON_DLAUNCH_TEST_SERVER", "shared-2")
        after = run_function(where, device="cpu")[0]
        assert after["server"] == os.getpid() and alive(before["server"]) and mine.is_alive()
    finally:
        mine.kill()
        mine.join()


SCRIPT = """
import os, sys, time
from launcher.launch.function import run_function

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imports"), "a") as imports:
    imports.write(f"{os.getpid()}\\n")  # once per process that runs this file's top level

def mine():
    return os.getpid()

def sleeper(path):
    open(f"{path}.{os.getpid()}", "w").close()
    time.sleep(600)

if __name__ == "__main__":
    warm = sys.argv[2] == "warm"
    print("ran", sorted(run_function(mine, device="cpu", warm=warm).values()), flush=True)
    run_function(sleeper, device="cpu", args=(sys.argv[1],), warm=warm)
"""


@pytest.mark.parametrize("how", ["warm", "fresh"])
def test_a_scripts_own_function_runs_and_killing_the_script_leaves_no_worker(tmp_path, how):
    """A function of the calling script (``__main__``) runs, and a SIGKILLed caller takes its workers with it (and
    the server they were forked from): nothing else would stop them. Fresh workers outlived it before. The call's
    scratch directory, which the killed caller could not remove, is no live call's: the next call removes it."""
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    scratch_root = Path(tempfile.mkdtemp(prefix="fn-"))  # the caller's TMPDIR: short, for the forkserver's socket path
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "pid"), how], cwd=tmp_path, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(scratch_root)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("ran ["), line
        ran = [int(pid) for pid in line.strip()[5:-1].split(", ")]
        imports = (tmp_path / "imports").read_text().split()
        assert [imports.count(str(pid)) for pid in ran] == [1, 1], imports  # a forked worker ran it twice before
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("pid.*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [int(p.suffix[1:]) for p in tmp_path.glob("pid.*")]
        assert len(workers) == 2
        parents = {process_state(pid)[1] for pid in workers}
        assert (parents == {proc.pid}) == (how == "fresh")  # warm: forked from the server, a child of the script
    finally:
        proc.kill()
        proc.wait()
    left = [pid for pid in (*workers, *parents) if pid != proc.pid]
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in left) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in left)
    try:
        (left_behind,) = scratch_root.glob(f"{scratch.PREFIX}*")  # the sleeper's call's; the first call removed its own
        assert scratch.sweep(scratch_root, settle_s=0) == [left_behind] and not left_behind.exists()
    finally:
        shutil.rmtree(scratch_root, ignore_errors=True)


PATH_ONLY = """
import os, sys
sys.path[:0] = [sys.argv[1]]  # dlaunch found through this script's sys.path alone (a checkout, no install)
sys.path.append(sys.argv[2])  # its dependencies' site-packages, without the .pth files that install dlaunch
from launcher.launch.function import run_function

def server_has_torch():
    with open(f"/proc/{os.getppid()}/maps") as maps:
        return os.getppid(), "libtorch" in maps.read()

if __name__ == "__main__":
    print(sorted(run_function(server_has_torch, device="cpu").values()), os.getpid(), flush=True)
"""


def test_a_caller_that_finds_dlaunch_through_its_own_path_gets_a_preloaded_server(tmp_path):
    """Before Python 3.14 the forkserver ignores the caller's sys.path while it preloads: torch and dlaunch were not
    imported there (silently), and every worker started cold. ``-S``: no site, so no install finds dlaunch."""
    script = tmp_path / "checkout.py"
    script.write_text(PATH_ONLY)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    site_packages = sysconfig.get_paths()["purelib"]
    proc = subprocess.run([sys.executable, "-S", str(script), str(ROOT), site_packages], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    results, caller = proc.stdout.strip().rsplit(" ", 1)
    (server, preloaded), again = ast.literal_eval(results)  # a list of tuples this test's script printed
    assert again == (server, preloaded) and server != int(caller)  # both forked from one server
    assert preloaded, proc.stderr
