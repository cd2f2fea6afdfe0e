"""How many CUDA devices this machine offers torch, told without importing torch.

The parent validates the config before anything starts, and a config error
should answer at once: importing torch alone takes seconds on a busy machine.

- A torch built without CUDA (the CPU wheel, macOS) sees no CUDA device, whatever
  the machine has: its ``lib/`` holds no ``torch_cuda`` library.
- A CUDA build asks the driver, as torch does (``cuInit``, ``cuDeviceGetCount``,
  which honour ``CUDA_VISIBLE_DEVICES``), for each device's compute capability too
  (``devices()``: the bf16 rule reads it). It does so in a short child process, so
  that this process never initialises CUDA, nor holds a context on a GPU its workers use.
  Where torch's CUDA build is newer than the driver supports, torch sees no device, and
  neither does this count (``driver_too_old`` says why).
- Where neither tells (a ROCm build, an unusual layout), torch itself is asked.

    >>> from launcher.cluster import gpus
    >>> gpus.count()  # doctest: +SKIP
    8
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

# Runs in a child: ``python -S -I -c`` starts in tens of milliseconds and imports nothing of ours. It prints the
# CUDA version the driver supports (cuDriverGetVersion: 12040 is 12.4) and one [major, minor, name] per device: the
# driver's compute capability (attributes 75 and 76) and name.
_ASK_THE_DRIVER = """
import ctypes, json
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    print(json.dumps({"cuda": 0, "devices": []}))
else:
    n, version, found = ctypes.c_int(0), ctypes.c_int(0), []
    cuda.cuDriverGetVersion(ctypes.byref(version))
    if cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0:
        for i in range(n.value):
            dev, major, minor, name = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.create_string_buffer(256)
            cuda.cuDeviceGet(ctypes.byref(dev), i)
            cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
            cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
            cuda.cuDeviceGetName(name, 256, dev)
            found.append([major.value, minor.value, name.value.decode(errors="replace")])
    print(json.dumps({"cuda": version.value, "devices": found}))
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


def driver_too_old() -> str | None:
    """Why torch sees none of the GPUs the driver shows: its CUDA build is newer than the driver supports (a CUDA 13
    wheel from PyPI on a driver for 12.x). torch then counts 0 devices, with a warning; dlaunch says why."""
    told = _driver() if torch_build() == "cuda" and sys.platform.startswith("linux") else None
    built = torch_cuda_version()
    if not told or not told[0] or not told[1] or built is None or told[0] // 1000 >= built[0]:
        return None
    supports = f"{told[0] // 1000}.{told[0] % 1000 // 10}"
    return (f"the installed torch is built for CUDA {built[0]}.{built[1]}, and this machine's NVIDIA driver supports CUDA "
            f"up to {supports}, so torch sees none of its {len(told[1])} GPU(s): update the driver, or install a torch "
            f"built for CUDA {told[0] // 1000}.x")


def torch_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the installed torch was built for, from its ``version.py`` (without importing torch)."""
    spec = importlib.util.find_spec("torch")
    places = list(spec.submodule_search_locations or []) if spec else []
    try:
        return cuda_version_of((Path(places[0]) / "version.py").read_text()) if places else None
    except OSError:
        return None


def cuda_version_of(text: str) -> tuple[int, int] | None:
    """``(13, 0)`` from a torch ``version.py`` that says ``cuda: Optional[str] = '13.0'``; None for a CPU build."""
    found = re.search(r"^cuda\b[^=\n]*=\s*['\"](\d+)\.(\d+)", text, re.MULTILINE)
    return (int(found[1]), int(found[2])) if found else None


def _driver_devices() -> tuple[Device, ...] | None:
    """The devices the driver shows, or none where torch's CUDA build is newer than the driver (torch sees none)."""
    told = _driver()
    return None if told is None else () if driver_too_old() else told[1]


@functools.cache
def _driver() -> tuple[int, tuple[Device, ...]] | None:
    """(the CUDA version the driver supports, e.g. 12040; its devices), or None where the child could not tell."""
    try:
        done = subprocess.run([sys.executable, "-S", "-I", "-c", _ASK_THE_DRIVER], capture_output=True, text=True, timeout=60)
        told = json.loads(done.stdout) if done.returncode == 0 else None
        return None if told is None else (int(told["cuda"]), tuple(Device(*d) for d in told["devices"]))
    except (OSError, ValueError, TypeError, KeyError, subprocess.TimeoutExpired):
        return None


def _torch_devices() -> tuple[Device, ...]:
    """Where the driver cannot be asked (a ROCm build): torch, which initialises CUDA in this process."""
    import torch

    return tuple(Device(*torch.cuda.get_device_capability(i), torch.cuda.get_device_name(i))
                 for i in range(_torch_count()))


def _torch_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_DATA_PARALLEL = ("mirrored", "multi_worker_mirrored", "fsdp", "mesh")


def unused_devices(strategy: str, nodes: int, per_node: int, device_type: str, here: int) -> str | None:
    """A note where a data-parallel strategy on this one machine leaves GPUs idle: tf.distribute's
    ``MirroredStrategy()`` takes every GPU it sees, and dlaunch the cluster it is given (``cluster=1x1`` by default);
    on the CPU, where that default is one replica in one process."""
    if nodes != 1 or strategy not in _DATA_PARALLEL:
        return None
    if device_type == "cpu" and per_node == 1 and strategy in ("mirrored", "multi_worker_mirrored"):  # fsdp warns itself
        return (f"strategy={strategy} over cluster=1x1 trains one replica, in this one process; cluster=1xN trains N, "
                "a process each")
    if device_type != "cuda" or per_node >= here:
        return None
    return (f"strategy={strategy} trains on {per_node} of this machine's {here} GPUs (cluster=1x{per_node}); "
            f"cluster=1x{here} uses them all")
