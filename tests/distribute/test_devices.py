"""launcher.distribute.devices: TF-style device names to canonical torch names."""

import pytest
import torch

from launcher import distribute as dl
from launcher.distribute import devices as devlib


@pytest.mark.parametrize(
    "name, expected",
    [
        ("cpu:0", "cpu:0"),
        ("/GPU:1", "cuda:1"),
        ("CPU:0", "cpu:0"),
        ("cuda", "cuda:0"),
        ("/job:worker/replica:0/task:0/device:GPU:3", "cuda:3"),
        ("gpu:2", "cuda:2"),
        ("cpu", "cpu:0"),
        ("  cuda:1  ", "cuda:1"),
    ],
)
def test_canonical_name_of_tf_style_string(name, expected):
    assert devlib.canonical_name(name) == expected


@pytest.mark.parametrize(
    "device, expected",
    [(torch.device("cpu"), "cpu:0"), (torch.device("cuda", 2), "cuda:2"), (torch.device("cuda"), "cuda:0")],
)
def test_canonical_name_of_torch_device(device, expected):
    assert devlib.canonical_name(device) == expected


@pytest.mark.parametrize("name", ["tpu:0", "/device:TPU:0", "xla:0", ""])
def test_canonical_name_rejects_unknown_device(name):
    with pytest.raises(ValueError, match="unknown device"):
        devlib.canonical_name(name)


def test_every_cpu_replica_computes_on_the_one_torch_cpu():
    assert devlib.to_torch("cpu:0") == torch.device("cpu")
    assert devlib.to_torch("CPU:1") == torch.device("cpu")


def test_gpu_name_maps_to_indexed_cuda_device():
    assert devlib.to_torch("/GPU:1") == torch.device("cuda", 1)


@pytest.mark.parametrize("make", [
    lambda gpu: dl.OneDeviceStrategy(gpu),
    lambda gpu: dl.MirroredStrategy(devices=["cpu:0", gpu]),
    lambda gpu: dl.experimental.CentralStorageStrategy(compute_devices=["CPU:0", gpu], parameter_device="CPU:0"),
    lambda gpu: dl.experimental.CentralStorageStrategy(compute_devices=["CPU:0"], parameter_device=gpu),
])
def test_a_gpu_the_machine_lacks_is_refused_when_the_strategy_is_made(make):
    """The central-storage seed names ['CPU:0', 'GPU:0']: on a machine without that GPU the constructor took it and
    the first run() failed with torch's "Cannot access accelerator device when none is available"."""
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"^cuda:{count} was asked for, but this machine has {count} CUDA device\(s\)"):
        make(f"GPU:{count}")
