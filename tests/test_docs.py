"""Every dlaunch command shown in docs/ runs (with a short run appended: 30 steps, on the CPU)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT, dlaunch

pytestmark = pytest.mark.slow
SHORT = ("trainer.steps=30", "trainer.log_every=10")


def commands() -> list[tuple[str, str]]:
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"```sh\n(.*?)```", page.read_text(), re.S):
            found += [(page.name, line.strip()) for line in block.splitlines() if line.strip().startswith("dlaunch ")]
    return found


@pytest.mark.parametrize("page,command", commands(), ids=[c for _, c in commands()])
def test_the_command_runs(page, command, tmp_path):
    proc = dlaunch(*command.split()[1:], *SHORT, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, f"{page}: {command}\n{proc.stderr[-3000:]}"
