"""Every shipped config composes and validates; every registered strategy has a config and a schema."""

from __future__ import annotations

import typing

import pytest
from omegaconf import OmegaConf

from launcher import strategies
from launcher.config import compose as composer
from launcher.config.schema import RunSpec, StrategySpec

RECIPES = sorted(composer.recipe_files())


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_validates_with_every_strategy_it_declares(recipe):
    declared = OmegaConf.load(composer.recipe_files()[recipe]).recipe.strategies
    assert declared, f"recipe {recipe} declares no strategies"
    shapes = {"one_device": ["cluster=1x1"], "central_storage": ["cluster=1x1"],  # central storage: one process
              "parameter_server": ["cluster.workers=2", "cluster.ps=2"]}
    for strategy in declared:
        shape = shapes.get(strategy, ["cluster=1x2"])
        spec = composer.compose_and_validate([f"recipe={recipe}", f"strategy={strategy}", *shape], cuda_devices=0)
        assert spec.strategy.name == strategy
        assert spec.recipe.name == recipe


def test_registry_files_and_schema_agree():
    tags = {typing.get_args(m.model_fields["name"].annotation)[0] for m in typing.get_args(typing.get_args(StrategySpec)[0])}
    assert set(strategies.available()) == tags == set(composer.file_options("strategy"))


def test_defaults_compose_to_one_device_linear():
    spec = composer.compose_and_validate([], cuda_devices=0)
    assert (spec.strategy.name, spec.cluster.shape, spec.recipe.name) == ("one_device", "1x1", "linear")
    assert spec.recipe.entry == "launcher.recipes.linear"


@pytest.mark.parametrize("shape,nodes,devices", [("1x1", 1, 1), ("1x3", 1, 3), ("1x16", 1, 16)])
def test_any_single_node_shape_is_an_option(shape, nodes, devices):
    spec = composer.compose_and_validate(["strategy=mirrored", f"cluster={shape}", "input.global_batch_size=48"], cuda_devices=0)
    assert (spec.cluster.nodes, spec.cluster.devices_per_node, spec.num_replicas) == (nodes, devices, nodes * devices)
    assert spec.per_replica_batch_size * spec.num_replicas == 48


def test_the_trainer_and_optimizer_keys_scripts_rely_on():
    spec = composer.compose_and_validate(["trainer.steps=7", "trainer.seed=3", "recipe.optimizer.lr=0.5"], cuda_devices=0)
    assert (spec.trainer.steps, spec.trainer.seed, spec.recipe.model_dump()["optimizer"]["lr"]) == (7, 3, 0.5)


def test_spec_round_trips_through_json_for_workers():
    spec = composer.compose_and_validate(["strategy=mirrored", "cluster=1x2"], cuda_devices=0)
    again = RunSpec.model_validate(spec.model_dump(mode="json"), context={"cuda_devices": 0})
    assert again == spec
