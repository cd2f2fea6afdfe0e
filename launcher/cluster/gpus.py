"""How many CUDA devices this machine offers torch, told without importing torch.

The parent validates the config before anything starts, and a config error
should answer at once: importing torch alone takes seconds on a busy machine.

- A torch built without CUDA (the CPU wheel, macOS) sees no CUDA device, whatever
  the machine has: its ``lib/`` holds no ``torch_cuda`` library.
- A CUDA build asks the driver, as torch does (``cuInit``, ``cuDeviceGetCount``,
  which honour ``CUDA_VISIBLE_DEVICES``), for each device's compute capability too
  (``devices()``: the bf16 rule reads it). It does so in a short child process, so
  that this process never initialises CUDA, nor holds a context on a GPU its workers use.
- Where neither tells (a ROCm build, an unusual layout), torch itself is asked.

    >>> from launcher.cluster import gpus
    >>> gpus.count()  # doctest: +SKIP
    8
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

# Runs in a child: ``python -S -I -c`` starts in tens of milliseconds and imports nothing of ours. It prints one
# [major, minor, name] per device: the driver's compute capability (attributes 75 and 76) and name.
_ASK_THE_DRIVER = """
import ctypes, json
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    print("[]")
else:
    n, found = ctypes.c_int(0), []
    if cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0:
        for i in range(n.value):
            dev, major, minor, name = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.create_string_buffer(256)
            cuda.cuDeviceGet(ctypes.byref(dev), i)
            cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
            cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
            cuda.cuDeviceGetName(name, 256, dev)
            found.append([major.value, minor.value, name.value.decode(errors="replace")])
    print(json.dumps(found))
"""


class Device(NamedTuple):
    """One CUDA device as the driver describes it."""

    major: int
    minor: int
    name: str

    @property
    def capability(self) -> tuple[int, int]:
        return self.major, self.minor


@functools.cache
def count() -> int:
    """The number of CUDA devices ``torch.cuda.device_count()`` would report (0 where CUDA is unavailable)."""
    build = torch_build()
    if build == "cpu":
        return 0
    told = _driver_devices() if build == "cuda" and sys.platform.startswith("linux") else None
    return len(told) if told is not None else _torch_count()


@functools.cache
def devices() -> tuple[Device, ...]:
    """Each CUDA device torch would see, with its compute capability, told without initialising CUDA here."""
    build = torch_build()
    if build == "cpu":
        return ()
    told = _driver_devices() if build == "cuda" and sys.platform.startswith("linux") else None
    return told if told is not None else _torch_devices()


def cpu_torch_beside_gpus(device_file: Path = Path("/dev/nvidia0")) -> bool:
    """This machine has an NVIDIA GPU (its driver's device file) that the installed torch, a CPU build, cannot use."""
    return device_file.exists() and torch_build() == "cpu"


def torch_build() -> str:
    """``cuda``, ``cpu`` or ``unknown``, from the files of the installed torch (without importing it)."""
    spec = importlib.util.find_spec("torch")
    places = list(spec.submodule_search_locations or []) if spec else []
    if not places:
        return "unknown"
    return build_of(Path(places[0]) / "lib")


def build_of(lib: Path) -> str:
    """The build a torch ``lib/`` folder belongs to, by the libraries in it."""
    if not lib.is_dir():
        return "unknown"
    names = [p.name for p in lib.iterdir()]
    if any("torch_cuda" in n for n in names):
        return "cuda"
    if any("torch_hip" in n or "amdhip" in n for n in names):
        return "unknown"  # ROCm: torch.cuda means HIP there, which the CUDA driver cannot count
    return "cpu"


@functools.cache
def _driver_devices() -> tuple[Device, ...] | None:
    try:
        done = subprocess.run([sys.executable, "-S", "-I", "-c", _ASK_THE_DRIVER], capture_output=True, text=True, timeout=60)
        return tuple(Device(*d) for d in json.loads(done.stdout)) if done.returncode == 0 else None
    except (OSError, ValueError, TypeError, subprocess.TimeoutExpired):
        return None


def _torch_devices() -> tuple[Device, ...]:
    """Where the driver cannot be asked (a ROCm build): torch, which initialises CUDA in this process."""
    import torch

    return tuple(Device(*torch.cuda.get_device_capability(i), torch.cuda.get_device_name(i))
                 for i in range(_torch_count()))


def _torch_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
