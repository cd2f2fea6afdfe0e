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
