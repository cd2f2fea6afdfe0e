"""How many CUDA devices this machine offers torch, told without importing torch.

The parent validates the config before anything starts, and a config error
should answer at once: importing torch alone takes seconds on a busy machine.

- A torch built without CUDA (the CPU wheel, macOS) sees no CUDA device, whatever
  the machine has: its ``lib/`` holds no ``torch_cuda`` library.
- A CUDA build asks the driver, as torch does (``cuInit``, ``cuDeviceGetCount``,
  which honour ``CUDA_VISIBLE_DEVICES``). It does so in a short child process, so
  that this process never initialises CUDA before it forks workers.
- Where neither tells (a ROCm build, an unusual layout), torch itself is asked.

    >>> from launcher.cluster import gpus
    >>> gpus.count()  # doctest: +SKIP
    8
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

# Runs in a child: ``python -S -I -c`` starts in tens of milliseconds and imports nothing of ours.
_ASK_THE_DRIVER = """
import ctypes
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    print(0)
else:
    n = ctypes.c_int(0)
    print(n.value if cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0)
"""


@functools.cache
def count() -> int:
    """The number of CUDA devices ``torch.cuda.device_count()`` would report (0 where CUDA is unavailable)."""
    build = torch_build()
    if build == "cpu":
        return 0
    if build == "cuda" and sys.platform.startswith("linux"):
        told = _driver_count()
        if told is not None:
            return told
    return _torch_count()


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


def _driver_count() -> int | None:
    try:
        done = subprocess.run([sys.executable, "-S", "-I", "-c", _ASK_THE_DRIVER], capture_output=True, text=True, timeout=60)
        return int(done.stdout.strip()) if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def _torch_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
