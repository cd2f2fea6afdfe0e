"""A reader that leaves early (``dlaunch ... | head``): the run goes on and ends with its own exit code."""

from __future__ import annotations

import io
import os
import subprocess

import pytest

from launcher.runtime.streams import ReaderMayLeave
from tests.conftest import command, summary


def test_a_stream_whose_reader_left_writes_to_dev_null_from_then_on():
    read, write = os.pipe()
    stream = ReaderMayLeave(io.TextIOWrapper(os.fdopen(write, "wb"), line_buffering=True))
    stream.write("first\n")
    assert os.read(read, 100) == b"first\n"
    os.close(read)  # the reader exits
    assert stream.write("second\n") == 7  # no BrokenPipeError
    stream.write("third\n")
    stream.flush()
    assert os.readlink(f"/proc/self/fd/{stream.fileno()}") == os.devnull
    stream.close()


@pytest.mark.slow
@pytest.mark.parametrize("both", [False, True], ids=["stdout", "stdout-and-stderr"])
def test_a_run_whose_reader_leaves_after_one_line_completes_and_exits_0(both, tmp_path):
    """Before, dlaunch's next write after `| head -1` exited ended it with exit 1 and no word, a completed run's
    summary saying completed; with stderr in the pipe too (`2>&1 | head`), a rank's log line could end the rank."""
    run_dir = tmp_path / "run"
    argv = command("recipe=linear", "strategy=mirrored", "cluster=1x2", "trainer.steps=300", "trainer.log_every=1",
                   f"hydra.run.dir={run_dir}")
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if both else subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip()  # the plan's first line
    proc.stdout.close()  # `head -1` exits
    err = proc.stderr.read() if not both else ""
    assert proc.wait(timeout=240) == 0, err[-3000:]
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]
    assert summary(run_dir)["status"] == "completed"
