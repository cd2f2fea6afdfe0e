"""``cluster=NxM``: N nodes x M devices each, an option of the ``cluster`` group without a file per shape.

The shapes a command can choose are generated into Hydra's ConfigStore before it composes: those its
overrides name (``cluster=2x8``, ``cluster=1x1,1x2`` in a sweep) and those a ``--config-dir`` primary
config's defaults list names (``- override cluster: 1x2``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import yaml

from launcher.config.overrides import key_of

SHAPE = re.compile(r"^(\d+)x(\d+)$")


def named(overrides: Iterable[str], config_dirs: Iterable[str], config_name: str) -> set[str]:
    """Every ``NxM`` the command line and its primary config may choose (1x1, the default, always)."""
    return {"1x1"} | _in_overrides(overrides) | _in_defaults(config_dirs, config_name)


def _in_overrides(overrides: Iterable[str]) -> set[str]:
    shapes = set()
    for text in overrides:
        if key_of(text) == "cluster":
            value = text.partition("=")[2]
            shapes |= {v for v in re.split(r"[,\s\[\]()]+", value) if SHAPE.match(v)}
    return shapes


def _in_defaults(config_dirs: Iterable[str], config_name: str) -> set[str]:
    """``cluster: NxM`` entries (``override cluster``, ``/cluster`` too) in the defaults list of each directory's
    primary config; a file that cannot be read is Hydra's to report."""
    shapes = set()
    for directory in config_dirs:
        path = Path(directory) / f"{config_name.removesuffix('.yaml')}.yaml"  # --config-name exp or exp.yaml
        try:
            data = yaml.safe_load(path.read_text()) if path.is_file() else None
        except (OSError, yaml.YAMLError):
            continue
        defaults = data.get("defaults") if isinstance(data, dict) else None
        for entry in defaults if isinstance(defaults, list) else []:
            for key, value in entry.items() if isinstance(entry, dict) else ():
                if str(key).split()[-1].lstrip("/") == "cluster" and SHAPE.match(str(value)):
                    shapes.add(str(value))
    return shapes


def node(shape: str, defaults: dict) -> dict:
    """The ``cluster`` section ``shape`` stands for: ``defaults`` with its nodes and devices per node."""
    nodes, devices = (int(v) for v in SHAPE.match(shape).groups())
    return {**defaults, "nodes": nodes, "devices_per_node": devices}
