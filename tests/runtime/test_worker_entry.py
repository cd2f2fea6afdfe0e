"""A fresh worker interpreter's entry: a Ctrl-C while it imports torch ends it quietly."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.conftest import ROOT


def test_a_ctrl_c_while_a_fresh_worker_imports_ends_it_quietly(tmp_path):
    """As the terminal's Ctrl-C reaches every rank of a CUDA or multi-node run while they start: exit 130 and no
    KeyboardInterrupt traceback from inside ``import torch``, where there was one per rank."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "launcher.runtime.worker_entry",
                             str(tmp_path / "job.json")], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:  # importtime's lines, each once an import has finished
            seen.append(line)
            if line.split("|")[-1].strip() == "rich.console":  # the worker's first import; torch's seconds are ahead
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert not any(line.split("|")[-1].strip() == "torch" for line in seen), "sent after torch's import"
    assert proc.returncode == 130, rest[-3000:]
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest
