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


def test_the_driver_is_asked_in_a_child_that_answers_a_number():
    told = gpus._driver_count()  # no libcuda here answers 0; a GPU machine its devices
    assert isinstance(told, int) and told >= 0
    if gpus.torch_build() == "cuda":  # a CPU wheel on a GPU machine sees none, whatever the driver says
        assert told == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_a_cpu_build_of_torch_beside_an_nvidia_gpu_is_told(tmp_path, monkeypatch):
    """dlaunch warns before training on the CPU of a GPU machine because the installed torch cannot see its GPUs."""
    device_file = tmp_path / "nvidia0"
    monkeypatch.setattr(gpus, "torch_build", lambda: "cpu")
    assert not gpus.cpu_torch_beside_gpus(device_file)  # no GPU: nothing to say
    device_file.touch()
    assert gpus.cpu_torch_beside_gpus(device_file)
    monkeypatch.setattr(gpus, "torch_build", lambda: "cuda")
    assert not gpus.cpu_torch_beside_gpus(device_file)
