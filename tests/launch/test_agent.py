"""The elastic agent's failure polling (launcher/launch/agent.py): an error file a full disk cut short."""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from launcher.launch.agent import set_aside_unreadable


@pytest.mark.parametrize("content", ["", '{"message": {"mess'])
def test_an_error_file_that_is_not_json_is_set_aside_so_the_failure_is_reported_not_raised(tmp_path, content):
    """A run directory on a full disk: torch's own error handler left error.json empty, and building the rank's
    ProcessFailure raised JSONDecodeError in the launcher (a 100-line traceback, no report, no summary)."""
    error_file = tmp_path / "error.json"
    error_file.write_text(content)
    with pytest.raises(json.JSONDecodeError):
        ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    set_aside_unreadable(str(error_file))
    assert not error_file.exists() and (tmp_path / "error.json.unreadable").read_text() == content
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.exitcode == 1  # reported as a rank that wrote no error file


def test_a_readable_or_missing_error_file_is_left_as_it_is(tmp_path):
    error_file = tmp_path / "error.json"
    set_aside_unreadable(str(error_file))  # missing: nothing to do
    error_file.write_text(json.dumps({"message": {"message": "ValueError: x", "extraInfo": {"timestamp": "0"}}}))
    set_aside_unreadable(str(error_file))
    assert error_file.exists() and not (tmp_path / "error.json.unreadable").exists()


EMPTY_ERROR_FILE = '''
import os

from launcher.recipes.linear import Config, build, evaluate  # noqa: F401
from launcher.recipes.linear import train_step as _train_step

calls = []


def train_step(model, batch):
    calls.append(1)
    if len(calls) == 3 and os.environ.get("RANK") == "1":  # what a full disk leaves: torch's handler wrote nothing
        open(os.environ["TORCHELASTIC_ERROR_FILE"], "w").close()
        os._exit(1)
    return _train_step(model, batch)
'''


@pytest.mark.parametrize("warm", ["true", "false"])  # forked workers (torch.multiprocessing) or fresh processes
def test_a_rank_that_leaves_an_empty_error_file_is_reported_not_a_launcher_traceback(tmp_path, warm):
    from tests.conftest import dlaunch

    (tmp_path / "empty_error.py").write_text(EMPTY_ERROR_FILE)
    proc = dlaunch(f"recipe.entry={tmp_path / 'empty_error.py'}", "recipe.name=linear", "strategy=mirrored", "cluster=1x2",
                   "trainer.steps=20", f"launch.warm_workers={warm}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "root cause" in out and "rank 1" in out and "JSONDecodeError" not in out and "Traceback" not in out, out[-3000:]
    assert list((tmp_path / "run" / "logs").rglob("error.json.unreadable")), "the empty error file was not set aside"
