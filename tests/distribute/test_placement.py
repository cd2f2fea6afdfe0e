"""Where modules built in ``scope()`` land: parameters and buffers move to the strategy's device when the
scope closes; the data a recipe makes stays where it made it; one seed gives one initialisation.

CI has no GPU. The ``meta`` device stands in for it: a build that only works on the CPU (a CPU
generator inside the scope, data made there, parameters initialised by a device's RNG) fails or
shows here as it would on CUDA (issue 15's crash: ``Expected a 'cuda' device type for generator``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from launcher import distribute as dl
from launcher.distribute.placement import Placement
from launcher.runtime import recipe as recipe_lib

META = dl.OneDeviceStrategy("meta:0")
RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def tensors_of(data) -> list[torch.Tensor]:
    """The tensors a recipe's dataset holds (TensorDataset and friends)."""
    found = list(getattr(data, "tensors", ()))
    for value in vars(data).values() if hasattr(data, "__dict__") else ():
        if isinstance(value, torch.Tensor):
            found.append(value)
    return found


@pytest.mark.parametrize("name", RECIPES)
def test_every_shipped_recipe_builds_on_a_non_cpu_device_with_its_data_untouched(name, tmp_path):
    from launcher.config.compose import compose_and_validate

    spec = compose_and_validate([f"recipe={name}", "cluster.device=cpu"], cuda_devices=0)
    loaded = recipe_lib.load(spec.recipe.model_dump())
    ctx = recipe_lib.BuildContext(strategy=META, seed=0, global_batch_size=spec.input.global_batch_size,
                                  per_replica_batch_size=spec.per_replica_batch_size, num_replicas_in_sync=1,
                                  run_dir=tmp_path, is_chief=True)
    torch.manual_seed(0)
    with META.scope():
        parts = loaded.module.build(loaded.config, ctx)
    assert {p.device.type for p in parts.model.parameters()} == {"meta"}
    assert {b.device.type for b in parts.model.buffers()} <= {"meta"}
    data = tensors_of(parts.train_data)
    assert data, f"{name}: found no tensors in its training data to check"
    assert {t.device.type for t in data} == {"cpu"}


def test_a_cpu_generator_and_data_work_inside_the_scope():
    with META.scope():
        g = torch.Generator().manual_seed(1)
        data = torch.randn(8, 3, generator=g)
        model = torch.nn.Linear(3, 1)
        assert model.weight.device.type == "cpu"  # built as outside a scope until the scope closes
    assert data.device.type == "cpu"
    assert model.weight.device.type == "meta" and model.bias.device.type == "meta"


def test_one_seed_gives_the_same_initial_parameters_inside_and_outside_a_scope():
    torch.manual_seed(7)
    plain = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    torch.manual_seed(7)
    with dl.OneDeviceStrategy("cpu:0").scope():
        scoped = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    for a, b in zip(plain.state_dict().values(), scoped.state_dict().values()):
        assert torch.equal(a, b)


def test_buffers_move_too():
    with META.scope():
        model = torch.nn.BatchNorm1d(4)
    assert model.running_mean.device.type == "meta" and model.num_batches_tracked.device.type == "meta"
    # (CPU to CUDA moves keep each Parameter object, so an optimizer made in the scope stays valid:
    # tests/strategies/test_cuda.py. A meta tensor cannot share a CPU one's type, so here they are new objects.)


def test_modules_built_outside_the_scope_stay_unless_a_module_built_inside_takes_them():
    alone, taken = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with META.scope():
        torch.nn.Sequential(taken)  # one model, one device
    assert alone.weight.device.type == "cpu" and taken.weight.device.type == "meta"


def test_deep_copied_layers_move_too():
    with META.scope():
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)  # copies the layer
    assert {p.device.type for p in encoder.parameters()} == {"meta"}


def test_the_innermost_placement_owns_a_module():
    anchor = torch.empty(0, device="meta")
    with dl.OneDeviceStrategy("cpu:0").scope():
        with dl.OneDeviceStrategy("cpu:0").extended.colocate_vars_with(anchor):
            inner = torch.nn.Linear(2, 2)
        outer = torch.nn.Linear(2, 2)
    assert inner.weight.device.type == "meta" and outer.weight.device.type == "cpu"


def test_another_threads_modules_are_not_moved():
    made = {}
    inside, release = threading.Event(), threading.Event()

    def build_elsewhere():
        inside.wait()
        made["other"] = torch.nn.Linear(2, 2)  # while this thread's scope is open
        release.set()

    thread = threading.Thread(target=build_elsewhere)
    thread.start()
    with Placement(torch.device("meta")):
        inside.set()
        release.wait(10)
    thread.join()
    assert made["other"].weight.device.type == "cpu"
