"""The console script's exit: Python's exit steps run, C++ destructors at interpreter exit do not."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap


def run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter whose Ctrl-C is a terminal's: a shell's background job would hand it SIGINT
    ignored, and then a test's SIGINT never comes."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_leave_waits_for_threads_runs_exit_handlers_flushes_and_keeps_the_code():
    proc = run("""
        import atexit, threading, time
        from launcher.cli.entry import leave
        atexit.register(lambda: print("exit handler", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
        print("unflushed ", end="")
        leave(7)
    """)
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "unflushed thread done\nexit handler\n"


def test_leave_shuts_an_open_executor_down_as_the_interpreter_would():
    """An executor's worker threads are not daemons: they end once its exit hook has run, not before."""
    proc = run("""
        from concurrent.futures import ThreadPoolExecutor
        from launcher.cli.entry import leave
        pool = ThreadPoolExecutor(2)
        pool.submit(print, "job ran")
        leave(0)
    """)
    assert proc.returncode == 0 and proc.stdout == "job ran\n", proc.stderr


def test_an_open_tcpstore_with_a_live_client_thread_does_not_abort_the_exit():
    """What torch elastic leaves behind after a signal: the rendezvous store, its keep-alive thread calling it.

    Exiting through the interpreter's finalisation aborts here (``terminate called without an active
    exception``, exit -6: measured 5 of 5 with torch 2.13); ``leave`` exits with the code asked for."""
    proc = run("""
        import threading, time
        from datetime import timedelta
        import torch.distributed as dist
        from launcher.cli.entry import leave
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
        def keep_alive():
            while True:
                store.set("k", "v")
                store.get("k")
        threading.Thread(target=keep_alive, daemon=True).start()
        time.sleep(0.2)
        leave(129)
    """)
    assert proc.returncode == 129 and "terminate called" not in proc.stderr, proc.stderr


def test_a_log_tailer_left_running_by_an_interrupted_agent_shutdown_does_not_hang_the_exit(tmp_path):
    """A second signal during torch elastic's stop of its workers can leave its TailLog running (a new user's
    double Ctrl-C under timeout(1): dlaunch never exited). Its threads end only when told; ``leave`` tells them."""
    log = tmp_path / "rank0.log"
    log.write_text("a worker's last line\n")
    proc = run(f"""
        import sys, time
        from torch.distributed.elastic.multiprocessing.tail_log import TailLog
        from launcher.cli.entry import leave
        tailer = TailLog("demo", {{0: {str(log)!r}}}, sys.stdout).start()  # held (as the agent holds it), never stopped
        time.sleep(0.5)
        leave(130)
    """)
    assert proc.returncode == 130, proc.stderr
    assert "a worker's last line" in proc.stdout


def test_a_python_without_the_private_exit_steps_exits_the_ordinary_way():
    """``threading._shutdown`` and ``atexit._run_exitfuncs`` are CPython's own: where they are missing,
    ``leave`` is ``sys.exit`` (the code, the handlers and the flush still hold)."""
    proc = run("""
        import atexit, threading
        del threading._shutdown
        from launcher.cli.entry import leave
        atexit.register(lambda: print("exit handler", flush=True))
        print("unflushed ", end="")
        leave(5)
    """)
    assert proc.returncode == 5, proc.stderr
    assert proc.stdout == "unflushed exit handler\n"


def test_one_more_ctrl_c_while_the_warm_server_is_reaped_keeps_the_exit_code_and_shows_no_traceback():
    """A second Ctrl-C lands after the run stopped, while entry() waits for the forkserver: torch elastic's
    handler raises SignalException there (a KeyboardInterrupt without it). The stop stands; other errors do not hide."""
    import pytest
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from launcher.runtime.stop_signals import cut_short

    for stop in (KeyboardInterrupt(), SignalException("Process 1 got signal: 2", sigval=signal.SIGINT)):
        with cut_short():
            raise stop
    with pytest.raises(OSError):
        with cut_short():
            raise OSError("a real problem")


def test_a_ctrl_c_while_leave_waits_for_a_thread_cuts_that_wait_short_and_keeps_the_code():
    """A new user's second Ctrl-C while dlaunch exits printed a traceback from its exit steps and exited 1: the
    run's line and its code (130) stand, and the exit handlers still run."""
    proc = run("""
        import atexit, os, signal, threading, time
        from launcher.cli.entry import leave
        atexit.register(lambda: print("exit handler", flush=True))
        threading.Thread(target=time.sleep, args=(60,)).start()  # not a daemon: leave() waits for it
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        print("dlaunch: stopped by Ctrl-C", flush=True)
        leave(130)
    """)
    assert proc.returncode == 130, proc.stderr
    assert proc.stdout == "dlaunch: stopped by Ctrl-C\nexit handler\n" and "Traceback" not in proc.stderr, proc.stderr


def test_a_ctrl_c_while_an_exit_handler_runs_is_let_go_without_atexits_traceback():
    """atexit prints a handler that a KeyboardInterrupt cut short as "Exception ignored ... KeyboardInterrupt"."""
    proc = run("""
        import atexit, os, signal, threading, time
        from launcher.cli.entry import leave
        atexit.register(lambda: (time.sleep(1), print("tidied", flush=True)))
        timer = threading.Timer(0.4, os.kill, (os.getpid(), signal.SIGINT))
        timer.daemon = True  # not waited for: the signal lands in the exit handler
        timer.start()
        leave(130)
    """)
    assert proc.returncode == 130 and proc.stdout == "tidied\n", proc.stderr
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_run_of_several_nodes_quiets_torchs_cpp_warnings_before_torch_loads(tmp_path):
    """torch reads TORCH_CPP_LOG_LEVEL as it loads, and checking the config (the recipe) loads it: set after that,
    a node whose peer's store went away printed ~90 lines of C++ `frame #N` warnings instead of dlaunch's one line."""
    seen = run(f"""
        import importlib.abc, os, sys

        class FirstTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "torch":
                    print("AT_TORCH_IMPORT", os.environ.get("TORCH_CPP_LOG_LEVEL"), file=sys.stderr, flush=True)
                    sys.meta_path.remove(self)
                return None

        sys.meta_path.insert(0, FirstTorch())
        sys.argv = ["dlaunch", "recipe=linear", "cluster=2x1", "cluster.device=cpu", "launch.dry_run=true",
                    "hydra.run.dir={tmp_path / 'run'}"]
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        from launcher.cli import entry
        entry.entry()
    """)
    assert "AT_TORCH_IMPORT ERROR" in seen.stderr, seen.stderr[-3000:]
