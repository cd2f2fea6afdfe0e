"""What run.py and micro.py share: the machine, CPU competition, statistics, markdown tables, result files.

Imports nothing heavy (no torch): the harness's own process should not compete with what it measures.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
BIN = Path(sys.executable).parent  # .venv/bin when run as .venv/bin/python (make bench)


def machine() -> dict[str, Any]:
    """nproc, the CPU model, torch's version, the Python and OS it ran on."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return {"nproc": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "cpu_model": model, "torch": torch_version, "python": platform.python_version(), "platform": platform.platform(),
            "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None}


class CpuWatch:
    """How many cores *other* processes kept busy while a command ran.

    /proc/stat's busy time of the whole machine, minus the CPU time of this
    process and its waited-for children (the command and what it started).
    About 0 on a quiet machine; 1.0 means one core's worth of someone else's work.
    """

    def __enter__(self) -> "CpuWatch":
        self.busy0, self.ours0, self.t0 = _machine_busy(), _our_cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        busy, ours = _machine_busy(), _our_cpu()
        self.other_cores = None if busy is None or self.busy0 is None else max(0.0, (busy - self.busy0) - (ours - self.ours0)) / wall


def _machine_busy() -> float | None:
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _our_cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def median(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def spread(values: Iterable[float | None]) -> dict[str, float | None]:
    """min, max and the interquartile range (q1, q3) of the non-missing values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"min": None, "max": None, "q1": None, "q3": None}
    q1, q3 = (statistics.quantiles(xs, n=4, method="inclusive")[i] for i in (0, 2)) if len(xs) > 1 else (xs[0], xs[0])
    return {"min": xs[0], "max": xs[-1], "q1": q1, "q3": q3}


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def write_results(stem: str, data: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """``benchmarks/results/STEM.json`` and ``STEM.md``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path, md_path = RESULTS / f"{stem}.json", RESULTS / f"{stem}.md"
    json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    md_path.write_text(markdown + "\n")
    return json_path, md_path


def publish(stem: str, data: dict[str, Any], markdown: str) -> None:
    """Write the results (``write_results``) and print the tables and where they went."""
    json_path, md_path = write_results(stem, data, markdown)
    print()
    print(markdown)
    print(f"\nresults: {json_path.relative_to(ROOT)}, {md_path.relative_to(ROOT)}")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's worker variables (a run must not think it is a worker), plus ``extra``."""
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TF_CONFIG", "DLAUNCH_TASK", "DLAUNCH_DEVICE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({"PYTHONUNBUFFERED": "1", "COLUMNS": "120", **extra})
    return env


def others_busy(window_s: float = 1.0) -> float | None:
    """Cores that other processes keep busy, sampled over ``window_s``."""
    with CpuWatch() as cpu:
        time.sleep(window_s)
    return cpu.other_cores


def wait_for_quiet(max_wait_s: float, threshold: float = 0.3) -> dict[str, Any]:
    """Wait (up to ``max_wait_s``) until other processes use fewer than ``threshold`` cores; say how it went.

    The machine may be shared: a timing taken while another process holds a core
    measures that process as much as this one (2-thread runs slow down tenfold).
    """
    started = time.perf_counter()
    busy = None
    while True:
        busy = others_busy()
        waited = time.perf_counter() - started
        if busy is None or busy < threshold or waited >= max_wait_s:
            return {"waited_s": waited, "others_before": busy, "quiet": busy is not None and busy < threshold}
