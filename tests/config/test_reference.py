"""docs/CONFIG.md is the schema's own reference: current, complete, and its defaults are the shipped ones."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from launcher.config import reference, schema
from tests.conftest import ROOT

PAGE = ROOT / "docs" / "CONFIG.md"


def rows(text: str) -> dict[str, list[str]]:
    found = {}
    for line in text.splitlines():
        match = re.match(r"\| `([\w.]+)` \| (.*) \|$", line)
        if match:
            found[match.group(1)] = [cell.strip() for cell in re.split(r"(?<!\\)\|", match.group(2))]
    return found


def test_the_page_is_the_schema_written_out():
    assert PAGE.read_text() == reference.render(), "run: python -m launcher.config.reference > docs/CONFIG.md"


def test_every_group_and_strategy_has_its_keys_listed():
    keys = rows(reference.render())
    for key in ("trainer.precision", "trainer.lr_schedule.warmup_steps", "input.prefetch", "launch.max_restarts",
                "cluster.devices_per_node", "strategy.bucket_cap_mb", "strategy.partitioner.kind",
                "strategy.device_assignment.computation_shape", "recipe.optimizer.lr", "sweep.objective"):
        assert key in keys, key
    assert keys["trainer.clip_grad_norm"][:2] == ["float (> 0) or null", "`null`"]
    assert keys["trainer.precision"][0] == r"fp32 \| bf16-mixed \| fp16-mixed"
    assert [key for key, (_, _, meaning) in keys.items() if not meaning] == []  # every key says what it does


def _yaml_defaults(node: dict, model: type, prefix: str):
    for key, value in node.items():
        field = model.model_fields[key]
        inner = reference._model_in(field.annotation)
        if inner is not None and isinstance(value, dict):
            yield from _yaml_defaults(value, inner, f"{prefix}{key}.")
        else:
            default = field.get_default(call_default_factory=True)
            yield f"{prefix}{key}", value, getattr(default, "value", default)


@pytest.mark.parametrize("page", ["config.yaml", *[f"strategy/{p.name}" for p in (ROOT / "conf" / "strategy").glob("*.yaml")]])
def test_the_shipped_yaml_defaults_are_the_schemas(page):
    """The reference shows the schema's defaults: they must be what a user gets from conf/."""
    tree = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / page))
    if page == "config.yaml":
        pairs = [p for group in ("trainer", "input", "launch", "sweep")
                 for p in _yaml_defaults(tree[group], schema.RunSpec.model_fields[group].annotation, f"{group}.")]
    else:
        name = tree.pop("name")
        spec = next(s for s in reference.strategy_specs() if reference.strategy_name(s) == name)
        pairs = list(_yaml_defaults(tree, spec, "strategy."))
    assert pairs and [(k, y) for k, y, d in pairs if y != d] == []
