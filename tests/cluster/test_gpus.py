"""Counting CUDA devices without importing torch: the same answer as torch, at once."""

import subprocess
import sys

import torch

from launcher.cluster import gpus


def test_the_count_is_torchs():
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert gpus.count() == expected


def test_the_count_imports_no_torch():
    code = "import sys; from launcher.cluster import gpus; gpus.count(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_a_build_is_told_by_its_libraries(tmp_path):
    assert gpus.build_of(tmp_path / "nowhere") == "unknown"
    (tmp_path / "libtorch_cpu.so").touch()
    assert gpus.build_of(tmp_path) == "cpu"  # the CPU wheel: no CUDA device, whatever the machine has
    (tmp_path / "libtorch_cuda.so").touch()
    assert gpus.build_of(tmp_path) == "cuda"
    (tmp_path / "libtorch_cuda.so").unlink()
    (tmp_path / "libtorch_hip.so").touch()
    assert gpus.build_of(tmp_path) == "unknown"  # ROCm: torch is asked


def test_the_driver_is_asked_in_a_child_that_answers_each_device():
    told = gpus._driver_devices()  # no libcuda here answers (); a GPU machine its devices
    assert isinstance(told, tuple) and all(isinstance(d, gpus.Device) for d in told)
    if gpus.torch_build() == "cuda":  # a CPU wheel on a GPU machine sees none, whatever the driver says
        assert len(told) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_each_devices_capability_and_name_are_torchs_without_initialising_cuda():
    """The bf16 rule reads the capability in the parent, which must not hold a CUDA context on a worker's GPU."""
    code = ("import torch; from launcher.cluster import gpus; found = gpus.devices(); "
            "print(torch.cuda.is_initialized(), [tuple(d) for d in found])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert done[0] == "False"
    if gpus.torch_build() == "cuda" and torch.cuda.is_available():
        expected = [(*torch.cuda.get_device_capability(i), torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]
        assert done[1].strip() == str(expected)
    else:
        assert done[1].strip() == "[]"


def test_a_cpu_build_of_torch_beside_an_nvidia_gpu_is_told(tmp_path, monkeypatch):
    """dlaunch warns before training on the CPU of a GPU machine because the installed torch cannot see its GPUs."""
    device_file = tmp_path / "nvidia0"
    monkeypatch.setattr(gpus, "torch_build", lambda: "cpu")
    assert not gpus.cpu_torch_beside_gpus(device_file)  # no GPU: nothing to say
    device_file.touch()
    assert gpus.cpu_torch_beside_gpus(device_file)
    monkeypatch.setattr(gpus, "torch_build", lambda: "cuda")
    assert not gpus.cpu_torch_beside_gpus(device_file)
