"""A fresh worker interpreter's entry: a Ctrl-C while it imports torch ends it quietly."""

from __future__ import annotations

import fcntl
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs Linux's F_SETPIPE_SZ")
def test_a_ctrl_c_while_a_fresh_worker_imports_ends_it_quietly(tmp_path):
    """As the terminal's Ctrl-C reaches every rank of a CUDA or multi-node run while they start: exit 130 and no
    KeyboardInterrupt traceback from inside ``import torch``, where there was one per rank."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "launcher.runtime.worker_entry",
                             str(tmp_path / "job.json")], cwd=ROOT, stderr=subprocess.PIPE, bufsize=0)
    # A one-page pipe, read without a buffer: the worker can be at most a page of importtime lines (a few imports)
    # past the line read, so the signal lands while torch is still to import, however fast the machine.
    fcntl.fcntl(proc.stderr.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    try:
        seen = []
        for raw in proc.stderr:  # importtime's lines, each once an import has finished
            line = raw.decode(errors="replace")
            seen.append(line)
            if line.split("|")[-1].strip() == "rich.console":  # the worker module's first import
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.stderr.read().decode(errors="replace")
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert not any(line.split("|")[-1].strip() == "torch" for line in seen), "sent after torch's import"
    assert proc.returncode == 130, rest[-3000:]
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest
