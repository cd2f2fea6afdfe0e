"""Counting CUDA devices without importing torch: the same answer as torch, at once."""

import subprocess
import sys

import pytest
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


def test_a_torch_built_for_a_newer_cuda_than_the_driver_sees_no_gpu_and_says_why(monkeypatch):
    """A CUDA 13.0 wheel (PyPI's default) on a driver for 12.4: torch counts 0 devices, so dlaunch must too (it counted
    8, planned nccl, and every worker failed in set_device), and it says why. The driver's answer is stood in for."""
    from launcher.config.compose import compose_and_validate
    from launcher.config.errors import ConfigError

    eight = tuple(gpus.Device(9, 0, "NVIDIA H100") for _ in range(8))
    monkeypatch.setattr(gpus, "torch_build", lambda: "cuda")
    monkeypatch.setattr(gpus, "torch_cuda_version", lambda: (13, 0))
    monkeypatch.setattr(gpus, "_driver", lambda: (12040, eight))
    monkeypatch.setattr(gpus.sys, "platform", "linux")
    assert gpus._driver_devices() == ()
    why = gpus.driver_too_old()
    assert why == ("the installed torch is built for CUDA 13.0, and this machine's NVIDIA driver supports CUDA up to 12.4, "
                   "so torch sees none of its 8 GPU(s): update the driver, or install a torch built for CUDA 12.x")
    with pytest.raises(ConfigError) as refused:
        compose_and_validate(["cluster.device=cuda"], cuda_devices=0)
    (p,) = refused.value.problems
    assert p.key == "cluster.device" and why in p.message
    for driver in (13000, 13020):  # the driver supports the build's major version: minor-version compatibility
        monkeypatch.setattr(gpus, "_driver", lambda driver=driver: (driver, eight))
        assert gpus.driver_too_old() is None and gpus._driver_devices() == eight


def test_the_cuda_version_is_read_from_torchs_version_file():
    assert gpus.cuda_version_of("__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\nhip = None\n") == (13, 0)
    assert gpus.cuda_version_of("cuda = '12.8'\n") == (12, 8)
    assert gpus.cuda_version_of("cuda: Optional[str] = None\n") is None  # a CPU build
    assert gpus.torch_cuda_version() == (tuple(int(x) for x in torch.version.cuda.split(".")[:2]) if torch.version.cuda else None)


@pytest.mark.parametrize("cause", ["cpu build", "old driver"])
def test_auto_on_the_cpu_of_a_gpu_machine_is_warned_with_the_cause(cause, monkeypatch, tmp_path, capsys):
    from launcher.cli import job
    from launcher.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job, "cuda_devices", lambda: 0)
    monkeypatch.setattr(gpus, "cpu_torch_beside_gpus", lambda: cause == "cpu build")
    monkeypatch.setattr(gpus, "driver_too_old", lambda: "the installed torch is built for CUDA 13.0, and ..." if cause == "old driver" else None)
    assert main(["launch.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    said = {"cpu build": "the installed torch is a CPU build, so cluster.device=auto trains on the CPU",
            "old driver": "cluster.device=auto trains on the CPU: the installed torch is built for CUDA 13.0"}
    assert said[cause] in err, err


def test_a_data_parallel_run_on_part_of_this_machines_gpus_or_one_cpu_replica_gets_a_note_naming_the_shape():
    from launcher.cluster.gpus import unused_devices

    assert unused_devices("mirrored", 1, 1, "cuda", 8) == ("strategy=mirrored trains on 1 of this machine's 8 GPUs "
                                                        "(cluster=1x1); cluster=1x8 uses them all")
    assert unused_devices("fsdp", 1, 8, "cuda", 8) is None  # every one
    assert unused_devices("one_device", 1, 1, "cuda", 8) is None  # one device is what it asks for
    assert unused_devices("mirrored", 2, 4, "cuda", 8) is None  # several machines: this one's count says nothing of theirs
    assert unused_devices("mirrored", 2, 1, "cpu", 8) is None and unused_devices("mirrored", 1, 2, "cpu", 8) is None
    assert unused_devices("mirrored", 1, 1, "cpu", 8) == ("strategy=mirrored over cluster=1x1 trains one replica, in "
                                                          "this one process; cluster=1xN trains N, a process each")
