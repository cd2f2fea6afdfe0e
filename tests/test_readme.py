"""The README's quickstart, and the custom-loop example of docs/TUTORIAL.md, run as written."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


def example(name: str) -> str:
    text = (ROOT / "docs" / "TUTORIAL.md").read_text()
    match = re.search(rf"<!-- docs-example: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"docs/TUTORIAL.md example {name} not found"
    return match.group(1)


def test_custom_loop_trains(tmp_path):
    script = tmp_path / "custom_loop.py"
    script.write_text(example("custom-loop"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    losses = [float(v) for v in re.findall(r"epoch \d: loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] / 10


def test_quickstart_shows_the_two_commands_first():
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1].split("##", 1)[0]
    assert quickstart.index("make demo") < quickstart.index("make test")
