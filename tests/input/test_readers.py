"""The formats' readers (launcher/input/readers.py): what they cannot read is named by file, line and format."""

from __future__ import annotations

import pytest

from launcher.input.readers import BadRows, read_file


CASES = [
    ("csv", "x,y\n1,2\n3,abc\n", ":3: column 'y' holds 'abc', not a number (a csv file holds a header row, then numbers)"),
    ("csv", "x,y\n1,2\n3,4,5\n", ":3: 3 value(s), but the header names 2 column(s)"),
    ("csv", "x,y\n1,2\n\n3\n", ":4: 1 value(s), but the header names 2 column(s)"),
    ("jsonl", '{"x": [1], "y": 2}\n{"x": [1], "y": 2\n', ":2: not a JSON object (Expecting ',' delimiter, column 18)"),
    ("jsonl", '{"x": [1], "y": 2}\n[1, 2]\n', ":2: every line must be a JSON object with the first line's fields"),
    ("jsonl", '{"x": [1], "y": 2}\n\n{"x": [1], "y": 2}\n{"x": [1, 2], "y": 2}\n',
     ":4: field 'x' holds [1, 2], where line 1 holds numbers of shape [1]; each line's 'x' must be a number, or "
     "numbers of one shape"),
    ("jsonl", '{"x": [1], "y": 2}\n{"x": [1], "y": null}\n',
     ":2: field 'y' holds null, where line 1 holds a number; each line's 'y' must be a number, or numbers of one shape"),
    ("jsonl", '{"x": [1], "y": 2}\n{"x": ["a"], "y": 2}\n',
     ":2: field 'x' holds [\"a\"], where line 1 holds numbers of shape [1]; each line's 'x' must be a number, or "
     "numbers of one shape"),
]


@pytest.mark.parametrize("fmt,text,message", CASES)
def test_a_row_it_cannot_read_is_named_by_file_and_line_in_its_formats_terms(tmp_path, fmt, text, message):
    path = tmp_path / f"data.{fmt}"
    path.write_text(text)
    with pytest.raises(BadRows) as caught:
        read_file(path, fmt)
    assert str(caught.value) == f"{path}{message}"
    assert fmt == "jsonl" or "JSON" not in str(caught.value)


def test_a_worker_stopped_by_a_bad_file_shows_one_line_not_the_readers_frames(run_dlaunch, tmp_path):
    data = tmp_path / "bad.csv"
    data.write_text("x,y\n1,2\n3,abc\n")
    proc, _ = run_dlaunch("cluster.device=cpu", f"input.files={data}", "recipe.features=1", "trainer.steps=2",
                          "input.global_batch_size=2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"BadRows: {data}:3: column 'y' holds 'abc', not a number" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "could not convert string to float" not in proc.stderr
