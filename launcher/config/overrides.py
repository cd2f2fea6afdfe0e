"""A command-line override's key, however the user wrote it: light enough for any module (no torch, no pydantic)."""

from __future__ import annotations


def key_of(override: str) -> str:
    """An override's key without Hydra's add/force/delete prefix (``++trainer.steps=5``: ``trainer.steps``), which
    names the same setting however the user wrote it."""
    return override.partition("=")[0].strip().lstrip("+~")
