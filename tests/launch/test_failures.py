"""How failures are told: one root cause, a line per other rank, completed ranks forgiven."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rich.console import Console
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from launcher.config.compose import compose_and_validate
from launcher.launch import failures, report
from launcher.runtime import outputs
from tests.conftest import PROBE, dlaunch

SPEC = compose_and_validate(["strategy=mirrored", "cluster=1x2"], cuda_devices=0)


def process_failure(tmp_path, rank: int, exitcode: int, exc: BaseException | None, when: float, extra: dict | None = None) -> ProcessFailure:
    error_file = tmp_path / f"error-{rank}.json"
    if exc is not None:
        try:
            raise exc
        except BaseException as raised:  # noqa: BLE001 - recorded like a worker does
            failures.write_error_file(str(error_file), raised, rank, extra)
        data = json.loads(error_file.read_text())
        data["dlaunch"]["time"] = when
        error_file.write_text(json.dumps(data))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_the_earliest_exception_is_the_root_cause(tmp_path):
    first = process_failure(tmp_path, 1, 1, ValueError("bad batch"), when=10.0)
    later = process_failure(tmp_path, 0, 1, RuntimeError("Connection reset by peer"), when=11.0)
    causes = [failures.from_process_failure(0, later), failures.from_process_failure(1, first)]
    root = failures.first(causes)
    assert root.rank == 1 and root.exception == "ValueError: bad batch"
    assert "ValueError: bad batch" in root.traceback


def test_render_shows_the_root_cause_once(tmp_path):
    root = failures.from_process_failure(1, process_failure(tmp_path, 1, 1, ValueError("bad batch"), 1.0))
    other = failures.from_process_failure(0, ProcessFailure(0, 99, -15, str(tmp_path / "none.json")))
    console = Console(record=True, width=120)
    failures.render(root, [other], last_logged=7, console=console)
    text = console.export_text()
    assert text.count("root cause") == 1
    assert "rank 1" in text and "last logged step 7" in text
    assert "rank 0: signal SIGTERM (stopped by dlaunch)" in text


def _waits_for_a_peer():
    raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                       "waiting 15000ms for recv operation to complete")


def test_another_ranks_line_names_where_its_own_code_was_without_gloos_source_path(tmp_path):
    """A rank that timed out in a collective: its line says what and where in the user's code, not gloo's C++ file."""
    root = failures.from_process_failure(1, process_failure(tmp_path, 1, 1, ValueError("bad batch"), 1.0))
    try:
        _waits_for_a_peer()
    except RuntimeError as exc:
        waiting = exc
    other = failures.from_process_failure(0, process_failure(tmp_path, 0, 1, waiting, 2.0))
    console = Console(record=True, width=200)
    failures.render(root, [other], last_logged=None, console=console)
    line = next(x for x in console.export_text().splitlines() if x.startswith("  rank 0:"))
    raised_at = _waits_for_a_peer.__code__.co_firstlineno + 1
    assert line == ("  rank 0: exit code 1: RuntimeError: Timed out waiting 15000ms for recv operation to complete "
                    f"(at test_failures.py:{raised_at})"), line


def test_the_root_cause_shows_the_last_completed_step_its_rank_recorded(tmp_path):
    failed = process_failure(tmp_path, 1, 1, ValueError("bad batch"), 1.0, extra={"last_step": 11, "operation": "train step 12"})
    root = failures.from_process_failure(1, failed)
    assert root.last_step == 11
    console = Console(record=True, width=120)
    failures.render(root, [], last_logged=10, console=console)
    text = console.export_text()
    assert "last completed step 11" in text and "last logged" not in text


def test_a_rank_killed_without_a_word_gets_its_last_step_from_its_heartbeat(tmp_path):
    (tmp_path / outputs.STATE_DIR).mkdir()
    outputs.write_json_atomic(outputs.progress_file(tmp_path, 1), {"step": 29, "operation": "train step 30"})
    killed = ProcessFailure(1, 4242, -9, str(tmp_path / "none.json"))
    assert report.report_child_failure(ChildFailedError("worker", {1: killed}), SPEC, tmp_path) == 1
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["last_completed_step"] == 29 and s["error"]["last_step"] == 29 and s["last_logged_step"] is None


def test_a_collective_timeout_is_the_root_cause_not_the_stuck_rank_stopped_after_it(tmp_path):
    from launcher.runtime.heartbeat import CollectiveTimeout

    explained = CollectiveTimeout('the gradient all-reduce in "train step 12" timed out after 20 s on rank 0 (the other '
                                  "ranks' heartbeats could not be read: Connection reset by peer)")
    timeout = failures.from_process_failure(0, process_failure(tmp_path, 0, 1, explained, when=5.0))
    stuck = failures.from_process_failure(1, ProcessFailure(1, 4242, -15, str(tmp_path / "none.json")))
    root = failures.first([stuck, timeout])
    assert root.rank == 0 and root.exception.startswith("CollectiveTimeout: the gradient all-reduce")
    assert root.traceback == "", "the message says it all"


def test_a_rank_that_completed_then_aborted_does_not_fail_the_run(tmp_path):
    (tmp_path / outputs.STATE_DIR).mkdir()
    for rank in (0, 1):
        outputs.completion_marker(tmp_path, rank).touch()
    aborted = ProcessFailure(1, 4242, -6, str(tmp_path / "none.json"))  # SIGABRT at exit, after its marker
    assert report.report_child_failure(ChildFailedError("worker", {1: aborted}), SPEC, tmp_path) == 0


def test_a_rank_that_aborted_before_completing_fails_the_run(tmp_path):
    (tmp_path / outputs.STATE_DIR).mkdir()
    outputs.completion_marker(tmp_path, 0).touch()
    aborted = ProcessFailure(1, 4242, -6, str(tmp_path / "none.json"))
    assert report.report_child_failure(ChildFailedError("worker", {1: aborted}), SPEC, tmp_path) == 1
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "failed" and s["error"]["exit"] == "signal SIGABRT"
    for key in ("strategy", "num_replicas_in_sync", "world_size", "global_batch_size", "steps", "first_loss",
                "final_loss", "examples_per_sec", "wall_seconds", "param_norm", "metrics"):
        assert key in s, key


def test_a_port_in_use_is_a_clean_error(tmp_path):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        proc = dlaunch("strategy=mirrored", "cluster=1x2", f"cluster.master_port={port}", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert proc.returncode == 1
    assert "cannot start the rendezvous" in proc.stdout + proc.stderr and "Traceback" not in proc.stdout + proc.stderr


def test_traceback_starts_at_user_code(tmp_path):
    script = tmp_path / "user_code.py"
    script.write_text(
        "from launcher import distribute as dl\n"
        "from launcher.launch import failures\n"
        "def user():\n    raise KeyError('x')\n"
        "try:\n    dl.OneDeviceStrategy('cpu:0').run(user)\n"
        "except KeyError as e:\n    print(failures.from_exception(e).traceback)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env={**os.environ}).stdout
    assert "in user" in out and "KeyError" in out
    assert "launcher/distribute" not in out, "dlaunch's own frames between the call and the user's code are hidden"


def test_a_killed_rank_is_the_root_cause_not_the_peer_that_lost_it(tmp_path):
    killed = ProcessFailure(1, 4242, -9, str(tmp_path / "none.json"))  # SIGKILL: no Python exception
    peer = process_failure(tmp_path, 0, 1, RuntimeError("[gloo/pair.cc:537] Read error: Connection reset by peer"), when=0.0)
    root = failures.first([failures.from_process_failure(0, peer), failures.from_process_failure(1, killed)])
    assert root.rank == 1 and root.exit == "signal SIGKILL"


def test_one_device_in_process_tells_the_last_completed_step_as_workers_do(tmp_path):
    """The same failure at step 5: the panel and summary.json say step 4 on one device (no worker process) too."""
    for strategy, cluster in (("one_device", "1x1"), ("mirrored", "1x2")):
        run_dir = tmp_path / strategy
        proc = dlaunch(f"strategy={strategy}", f"cluster={cluster}", f"recipe.entry={PROBE}", "trainer.steps=10",
                       "+recipe.fail_replica=0", "+recipe.fail_step=5", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "last completed step 4" in " ".join((proc.stdout + proc.stderr).split()), (strategy, proc.stderr[-3000:])
        assert json.loads((run_dir / "summary.json").read_text())["last_completed_step"] == 4, strategy
        # RUN_DIR/dlaunch.log keeps what the terminal showed: rank 0's progress (a worker's, under mirrored)
        # and the root cause, once
        text = (run_dir / "dlaunch.log").read_text()
        assert "][dlaunch][INFO] - step 1/10" in text and text.count("root cause") == 1, (strategy, text)
        assert "last completed step 4" in text, (strategy, text)


def test_torchs_advice_to_pass_a_ddp_argument_gets_dlaunchs_setting_under_it(tmp_path):
    """DDP's unused-parameter error tells the user to pass find_unused_parameters=True to its constructor, which
    dlaunch builds: the recorded error names strategy.find_unused_parameters=true, once."""
    ddp_said = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one. You can "
                            "enable unused parameter detection by passing the keyword argument `find_unused_parameters=True` "
                            "to `torch.nn.parallel.DistributedDataParallel`")
    failure = process_failure(tmp_path, 1, 1, ddp_said, 1.0)
    root = failures.from_process_failure(1, failure)
    assert root.traceback.rstrip().endswith("dlaunch: set strategy.find_unused_parameters=true (DDP's "
                                            "find_unused_parameters), or make every parameter take part in the loss")
    assert failures.advise(ddp_said).__notes__ == [root.traceback.rstrip().splitlines()[-1]]  # not twice
    assert not hasattr(failures.advise(ValueError("another")), "__notes__")


def test_a_rank_that_exited_0_before_the_run_finished_is_the_root_cause_and_one_that_completed_is_not(tmp_path):
    (tmp_path / outputs.STATE_DIR).mkdir()
    outputs.completion_marker(tmp_path, 2).touch()
    left = ProcessFailure(1, 4242, 0, str(tmp_path / "none.json"))  # os._exit(0) mid-run: no error file, no marker
    peer = process_failure(tmp_path, 0, 1, RuntimeError("[gloo/pair.cc:537] Connection closed by peer"), when=9e9)
    done = ProcessFailure(2, 4343, 0, str(tmp_path / "none.json"))
    real, finished = report.causes_of(ChildFailedError("worker", {0: peer, 1: left, 2: done}), tmp_path, SPEC)
    root = failures.first(real)
    assert root.rank == 1 and root.exception.startswith("rank 1 exited with code 0 before the run finished")
    assert sorted(c.rank for c in real) == [0, 1] and finished == []


def test_a_rank_that_calls_os_exit_0_mid_run_is_named_as_the_root_cause(tmp_path):
    """Its peers failed at their next collective, and the panel named one of them: never the rank that had left."""
    run_dir = tmp_path / "run"
    proc = dlaunch(f"recipe.entry={PROBE}", "strategy=multi_worker_mirrored", "cluster=1x2", "trainer.steps=30",
                   "trainer.log_every=1", "+recipe.exit_replica=1", "+recipe.exit_step=5", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "worker rank 1 failed: root cause" in text and "rank 1 exited with code 0 before the run finished" in text
    error = json.loads((run_dir / "summary.json").read_text())["error"]
    assert (error["rank"], error["exit"], error["last_step"]) == (1, "exit code 0", 4)


def test_ranks_that_failed_with_one_message_name_the_lowest_and_the_others_say_the_same(tmp_path):
    """Every rank checks recipe.features against the first input file, rank 0's under FILE sharding: the panel
    named whichever rank won the race (rank 1) while quoting that file, and repeated the message for rank 0."""
    message = "FieldWidth: data/train-00000.jsonl: field 'x' holds 32 number(s) per row"
    raced = [failures.from_process_failure(r, process_failure(tmp_path, r, 1, ValueError(message), when=10.0 - r))
             for r in (0, 1)]
    root = failures.first(raced)
    assert root.rank == 0
    console = Console(record=True, width=200)
    failures.render(root, [c for c in raced if c is not root], last_logged=None, console=console)
    text = console.export_text()
    assert "worker rank 0 failed: root cause" in text, text
    assert text.splitlines()[-1] == "  rank 1: exit code 1: the same ValueError as rank 0", text


def test_the_failure_text_a_run_directory_keeps_is_not_wrapped(tmp_path):
    """error.txt is a file: a long line (another rank's, with where its code was) stays one line, not cut at 120."""
    message = "a long message from my script: " + "x" * 150
    root = failures.from_process_failure(1, process_failure(tmp_path, 1, 1, ValueError(message), 1.0))
    other = failures.from_process_failure(0, process_failure(tmp_path, 0, 1, RuntimeError(message), 2.0))
    text = failures.as_text(root, [other], last_logged=None)
    assert f"  ValueError: {message}" in text.splitlines()
    assert any(line.startswith("  rank 0: exit code 1: RuntimeError: a long message") and "(at test_failures.py:" in line
               for line in text.splitlines()), text


MISMATCH = """\
import torch
import torch.distributed as dist

from launcher import distribute as dl

dl.get_strategy()
size = 10 if dist.get_rank() == 0 else 3  # a collective whose shape differs by rank
dist.all_reduce(torch.ones(size))
"""


def test_a_rank_that_gloo_aborts_gets_gloos_words_and_its_own_line_in_the_panel(tmp_path):
    """A collective mismatch: gloo throws in C++, and the rank dies by SIGABRT without a Python exception. The panel
    said only `signal SIGABRT` (the cause was 35 lines up, in a stack dump with dlaunch's frames in it)."""
    (tmp_path / "mismatch.py").write_text(MISMATCH)
    proc = dlaunch("script=mismatch.py", "strategy=mirrored", "cluster=1x2", f"hydra.run.dir={tmp_path / 'run'}",
                   cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    panel = " ".join(proc.stderr[proc.stderr.index("failed: root cause"):].split())
    assert "signal SIGABRT" in panel and "Is there a distributed collective mismatch in your code?" in panel, panel
    assert "gloo::EnforceNotMet: " in panel and "enforce fail at" not in panel, panel  # gloo's source path left out
    assert 'mismatch.py", line 8, in <module>' in panel and "launcher/" not in panel, panel
    error = json.loads((tmp_path / "run" / "summary.json").read_text())["error"]
    assert "collective mismatch" in error["exception"] and error["exit"] == "signal SIGABRT"


SEGFAULT = """\
import ctypes
import torch.distributed as dist

from launcher import distribute as dl

dl.get_strategy()
if dist.get_rank() == 0:
    ctypes.string_at(0)  # a native crash on the rank whose stderr is the terminal
dist.barrier()
"""


def test_rank_0s_native_crash_shows_its_stack_once_in_the_root_cause(tmp_path):
    """Rank 0 keeps the terminal, so its stderr has no log: its segfault's root cause said only `signal SIGSEGV`,
    after faulthandler's 40-line dump on the terminal. Every rank's dump now goes to its fault log, which the root
    cause reads."""
    (tmp_path / "crash.py").write_text(SEGFAULT)
    proc = dlaunch("script=crash.py", "strategy=mirrored", "cluster=1x2", "cluster.device=cpu",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    panel = proc.stderr[proc.stderr.index("failed: root cause"):]
    assert "rank 0" in panel.splitlines()[1] and "signal SIGSEGV" in panel, panel
    assert 'crash.py", line 8, in <module>' in panel and "launcher/" not in panel, panel
    assert proc.stderr.count("Fatal Python error: Segmentation fault") == 1, proc.stderr[-3000:]
    assert "Extension modules" not in proc.stderr  # the dump itself is in the fault log, not on the terminal
    error = json.loads((tmp_path / "run" / "summary.json").read_text())["error"]
    assert error["exception"] == "Fatal Python error: Segmentation fault" and "crash.py" in error["traceback"]


def test_a_c_plus_plus_abort_gets_its_words_from_stderr_and_its_stack_from_the_fault_log(tmp_path):
    stderr, fault = tmp_path / "stderr.log", tmp_path / "fault.log"
    stderr.write_text("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
                      "gloo/x.cc:1] op.preamble.length <= op.nbytes. Is there a collective mismatch?\n")
    fault.write_text('Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n'
                     '  File "/home/me/train.py", line 7 in <module>\n\nExtension modules: numpy\n')
    exception, stack = failures.native_crash(stderr, fault)
    assert exception == "gloo::EnforceNotMet: op.preamble.length <= op.nbytes. Is there a collective mismatch?"
    assert stack.splitlines()[1:] == ['  File "/home/me/train.py", line 7, in <module>']
    assert failures.fault_log(str(tmp_path / "0" / "error.json")) == tmp_path / "0" / "fault.log"
    assert failures.fault_log(os.devnull) is None and failures.fault_log(None) is None


@pytest.mark.parametrize("crashed", ["Current thread", "Thread"])  # a thread Python knows; one it does not (gloo's)
def test_a_segfault_gives_pythons_fatal_error_and_the_stack_of_the_ranks_own_thread(tmp_path, crashed):
    """faulthandler lists the newest thread first: dlaunch's heartbeat, here; the stack shown is the thread that
    crashed, else the one that ran the rank's code, inside dlaunch's frames."""
    import threading

    log = tmp_path / "stderr.log"
    log.write_text(
        "Fatal Python error: Segmentation fault\n\nThread 0x00007f01 (most recent call first):\n"
        f'  File "{threading.__file__}", line 331 in wait\n  File "{failures._PACKAGE_DIR}/runtime/heartbeat.py", '
        f'line 80 in beat\n  File "{threading.__file__}", line 1045 in _bootstrap\n\n'
        f"{crashed} 0x00007f00 (most recent call first):\n"
        '  File "/site-packages/mylib/ext.py", line 12 in crash\n  File "/home/me/train.py", line 40 in step\n'
        f'  File "{failures._PACKAGE_DIR}/runtime/script.py", line 90 in run\n  File "<string>", line 1 in <module>\n\n'
        "Extension modules: numpy\n")
    exception, stack = failures.native_crash(log)
    assert exception == "Fatal Python error: Segmentation fault"
    assert stack.splitlines()[1:] == ['  File "/home/me/train.py", line 40, in step',
                                      '  File "/site-packages/mylib/ext.py", line 12, in crash']
    assert failures.native_crash(tmp_path / "missing.log") == ("", "")


def test_a_crashed_rank_forked_from_a_forked_server_shows_none_of_the_forking_programs_frames(tmp_path):
    """A worker's server forked from a running program (``launch/forked_server.py``: the suite's prewarmed commands)
    keeps that program's frames below the rank's own: they are outside dlaunch's innermost frame, so not shown."""
    from launcher.launch import forked_server

    log = tmp_path / "stderr.log"
    log.write_text(
        "Fatal Python error: Segmentation fault\n\nThread 0x00007f00 (most recent call first):\n"
        '  File "/home/me/train.py", line 40 in step\n'
        f'  File "{failures._PACKAGE_DIR}/runtime/worker.py", line 90 in run_job\n'
        f'  File "{forked_server.__file__}", line 99 in _serve\n'
        f'  File "{forked_server.__file__}", line 70 in fork\n  File "/home/me/harness.py", line 12 in serve\n\n'
        "Extension modules: numpy\n")
    _, stack = failures.native_crash(log)
    assert stack.splitlines()[1:] == ['  File "/home/me/train.py", line 40, in step']


def test_torchs_module_calls_between_the_users_frames_are_hidden_not_the_frame_that_raised():
    """A shape error in a Sequential under DDP showed about 8 frames of torch's call plumbing (``_wrapped_call_impl``,
    ``_call_impl``, DDP's ``forward``) between the user's line and the op that raised."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(4, 1))

    def train_step():
        return model(torch.ones(2, 3))

    try:
        train_step()
    except RuntimeError as exc:
        text = failures._format(exc)
    assert "(dlaunch's own frames and torch's module calls are hidden)" in text
    assert "in train_step" in text and "container.py" in text and "linear.py" in text, text
    assert "_call_impl" not in text and "_wrapped_call_impl" not in text, text
    model[1].register_forward_hook(lambda *args: None)  # a module with hooks is called through _call_impl's `inner`
    try:
        train_step()
    except RuntimeError as exc:
        text = failures._format(exc)
    assert "in train_step" in text and "linear.py" in text and " in inner\n" not in text, text


def test_loss_backward_passes_on_to_the_engine_unseen():
    """A rank whose peer died fails in backward: its root cause showed torch/_tensor.py and autograd/__init__.py
    frames under the note that torch's calls are hidden (a multi-node review)."""
    import torch

    x = torch.ones(2, requires_grad=True)

    def fails(grad):
        raise RuntimeError("a peer is gone")

    x.register_hook(fails)
    try:
        (x * 2).sum().backward()
    except RuntimeError as exc:
        text = failures._format(exc)
    assert "test_failures.py" in text and "_tensor.py" not in text and "autograd/__init__.py" not in text, text
