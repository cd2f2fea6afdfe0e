"""An override's key however the user wrote it (launcher/config/overrides.py)."""

import subprocess
import sys

import pytest

from launcher.config.overrides import key_of


@pytest.mark.parametrize("override, key", [
    ("trainer.steps=5", "trainer.steps"),
    ("+trainer.steps=5", "trainer.steps"),
    ("++trainer.steps=5", "trainer.steps"),
    ("~trainer.steps", "trainer.steps"),
    ("~trainer.steps=5", "trainer.steps"),
    ("cluster=1x2,2x1", "cluster"),
    ("script.args=[--lr=0.1]", "script.args"),  # only the first '=' ends the key
    ("strategy", "strategy"),
])
def test_the_key_drops_hydras_prefixes_and_the_value(override, key):
    assert key_of(override) == key


def test_the_module_loads_nothing_heavy():
    """The CLI's light paths (resume's arguments, the warm server's guess) read keys before torch or pydantic load."""
    code = "import sys, launcher.config.overrides; print(sorted(m for m in ('torch', 'pydantic', 'hydra') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
