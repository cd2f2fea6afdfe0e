"""tpu_strategy.txt's model-parallel examples, line for line, on MeshStrategy: real gloo processes and one process."""

from __future__ import annotations

import os

import pytest
import torch

from launcher.distribute.device_assignment import DeviceAssignment, Topology
from launcher.launch.function import run_function

pytestmark = pytest.mark.slow


def _strategy(computation_shape: list[int], num_replicas: int):
    from launcher.strategies.mesh import MeshStrategy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    return MeshStrategy(DeviceAssignment.build(Topology.from_devices(world), computation_shape, num_replicas=num_replicas))


def replicate_example(logical: int = 2, replicas: int = 2) -> dict:
    """Split the images, run the model, replicate labels and output, compute the loss (2 logical devices x 2 replicas).

    The seed splits [1, 2, 4, 1] over 2 logical devices, which its own rule 2 refuses (the product
    must be the number of logical devices): the split here is [1, 2, 1, 1].
    """
    s = _strategy([1, 1, 1, logical], replicas)
    images = torch.arange(2 * 4 * 6 * 3, dtype=torch.float32).reshape(2, 4, 6, 3) / 100
    labels = torch.tensor([1.0, 2.0])
    weight = torch.tensor(0.5, requires_grad=True)

    def model(x):
        return x.sum(dim=(1, 2, 3)) * weight  # partial sums over the split dim, combined by DTensor

    def step_fn(inputs):
        images, labels = inputs
        images = s.experimental_split_to_logical_devices(images, [1, logical, 1, 1])
        output = model(images)
        labels = s.experimental_replicate_to_logical_devices(labels)
        output = s.experimental_replicate_to_logical_devices(output)
        loss = ((labels - output) ** 2).mean()  # the seed's loss_fn(labels, output): annotated tensors mixed
        assigned = s.experimental_assign_to_logical_device(output, 0)
        mixed = images.sum() + assigned.sum() - labels.sum()  # split + assigned + replicated, in one expression
        _plain(loss).backward()
        return loss, mixed

    loss, mixed = (s.experimental_local_results(v)[0] for v in s.run(step_fn, args=((images, labels),)))
    return {"loss": _plain(loss).detach(), "mixed": _plain(mixed).detach(), "grad": _plain(weight.grad), "images": images,
            "labels": labels}


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _expected(images: torch.Tensor, labels: torch.Tensor) -> tuple:
    weight = torch.tensor(0.5, requires_grad=True)
    output = images.sum(dim=(1, 2, 3)) * weight
    loss = ((labels - output) ** 2).mean()
    loss.backward()
    return loss.detach(), images.sum() + output.sum().detach() - labels.sum(), weight.grad


def test_the_replicate_example_combines_split_and_replicated_tensors_in_processes():
    for r in run_function(replicate_example, device="cpu", nproc=4).values():
        loss, mixed, grad = _expected(r["images"], r["labels"])
        torch.testing.assert_close(r["loss"], loss)
        torch.testing.assert_close(r["mixed"], mixed)
        torch.testing.assert_close(r["grad"], grad)  # every logical device's gradient of the shared weight


def test_the_replicate_example_in_one_process():
    r = replicate_example(1, 1)  # one logical device: every annotation is the identity
    loss, mixed, grad = _expected(r["images"], r["labels"])
    torch.testing.assert_close(r["loss"], loss)
    torch.testing.assert_close(r["grad"], grad)


def assign_example() -> dict:
    """The seed's dataset_fn (unseeded np.random) and step_fn with assign_to_logical_device, 2 logical devices x 1 replica."""
    import numpy as np

    s = _strategy([1, 1, 1, 2], 1)
    calls = []

    def dataset_fn(ctx):
        calls.append(ctx.input_pipeline_id)
        x = np.random.random((2, 5)).astype(np.float32)
        y = np.random.randint(2, size=(2, 1))
        rows = list(zip(torch.from_numpy(x), torch.from_numpy(y)))  # from_tensor_slices
        batches = [(f.unsqueeze(0), l.unsqueeze(0)) for f, l in rows]  # .batch(1, drop_remainder=True)
        return batches * 3  # .repeat(), three times round

    def step_fn(inputs):
        features, _ = inputs
        output = features + features
        return s.experimental_assign_to_logical_device(output, 0), features

    dist_dataset = s.experimental_distribute_datasets_from_function(dataset_fn)
    iterator = iter(dist_dataset)
    output, features = s.run(step_fn, args=(next(iterator),))  # one replica: plain values
    return {"calls": len(calls), "features": features, "output": _plain(output)}


def test_a_replicas_logical_devices_read_one_input():
    results = run_function(assign_example, device="cpu", nproc=2)
    assert results[0]["calls"] == 1 and results[1]["calls"] == 0  # dataset_fn once per replica
    torch.testing.assert_close(results[0]["features"], results[1]["features"])
    for r in results.values():
        torch.testing.assert_close(r["output"], results[0]["features"] * 2)  # its own value, device 0's too
