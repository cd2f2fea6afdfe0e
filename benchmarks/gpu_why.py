"""Why is one loop's step slower than the other's? Both, caught in their steady steps and looked at from outside.

    python benchmarks/gpu_why.py                       # bf16+compile, on the GPU
    python benchmarks/gpu_why.py --mode bf16 --seconds 8
    python benchmarks/gpu_why.py --device cpu --tiny   # the wiring, on the CPU

``gpu.py --profile`` showed the same GPU time per step in dlaunch and in the hand loop, and about 40% more
host time for nearly every op in dlaunch: a sign of contention on the host, not of extra work. This runs one
dlaunch run and one hand-loop run (gpu.py's commands) in turn. Once a run has logged step ``--after``, it
records, over ``--seconds``:

- its time per step meanwhile (from when its logged steps were printed);
- the CPU each of the process's threads used (``/proc``), and that of its children (compile workers); how often
  each thread was preempted (involuntary context switches per second: a thread that wants a core and waits for
  it) and the core it last ran on, with that core's NUMA node (the GPU's is read from sysfs);
- the busiest other processes on the machine meanwhile, and the load average;
- the CPU cores it may run on, the number of its threads, and the environment variables that torch reads;
- where its threads are, with py-spy where it is installed and may attach (``py-spy dump``), and what its
  main thread spends its time in (``py-spy record``, Python frames: each function's share of the samples);
- then, for 2 s, every thread with C++ frames (``py-spy record --native``, which pauses the process: after the
  window that times the steps): where the host's time goes below Python (the caching allocator, the driver's calls).

Then it stops the run. Writes ``benchmarks/results/TIMESTAMP-gpu-why.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402
import gpu  # noqa: E402

TINY = {"d_model": 16, "heads": 2, "layers": 1, "context": 16}
ENV_KEYS = re.compile(r"^(OMP_|MKL_|KMP_|GOMP_|TORCH|PYTORCH|CUDA_|NCCL_|PYTHON)")
TICKS = os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="bf16+compile", choices=list(gpu.MODES))
    parser.add_argument("--after", type=int, default=200, help="start looking once a run has logged this step")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to look at each run")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny charlm (the CPU test of the wiring)")
    parser.add_argument("--limit", type=float, default=100.0, help="seconds a run may take to reach step --after")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a caller's `timeout`: stop the runs on the way out
    shape, batch = (TINY, 4) if args.tiny else (gpu.SHAPE, gpu.BATCH)
    steps = 100_000  # stopped once looked at
    dl_args, loop_args = gpu.MODES[args.mode]
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        commands = {"dlaunch": gpu.dlaunch_command(dl_args, steps, work / "run", shape, batch, args.device),
                    "hand": gpu.hand_command(loop_args, steps, work / "hand.json", shape, batch, args.device)}
        for who, command in commands.items():
            try:
                found[who] = look(who, command, args.after, args.seconds, work, args.limit)
            except LookFailed as exc:  # the other run is still worth its look
                found[who] = {"failed": str(exc)}
                print(f"{who}: {exc}", flush=True)
                continue
            print(f"{who}: {c.fmt(found[who]['ms_per_step'])} ms/step; {found[who]['threads_line']}", flush=True)
    c.publish(f"{c.timestamp()}-gpu-why", {"mode": args.mode, "device": args.device, "ptrace_scope": _ptrace_scope(),
                                           "runs": found}, report(args.mode, found, _ptrace_scope()))


class LookFailed(Exception):
    """A run ended, or took too long, before the step to look at."""


def _ptrace_scope() -> str:
    """Yama's ptrace_scope (1: only a parent may attach, unless the target allows it): py-spy's chance to look."""
    try:
        return Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        return "(no Yama)"


def _traceable_and_mortal() -> None:
    """In the run, before it execs: it may be traced by any process (py-spy is its sibling, not its parent, where
    Yama's ptrace_scope is 1), and it dies with this script (a `timeout` that kills the script kills the run)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, PR_SET_PTRACER_ANY (Yama; else ignored)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def look(who: str, command: list[str], after: int, seconds: float, work: Path, limit: float = 100.0) -> dict[str, Any]:
    """Start ``command``, wait (at most ``limit`` seconds) for its step ``after``, look at it for ``seconds``, stop it."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=c.clean_env(),
                            cwd=work if who == "dlaunch" else c.ROOT, start_new_session=True,
                            preexec_fn=_traceable_and_mortal)
    tail: collections.deque = collections.deque(maxlen=40)
    logged: list[tuple[float, int]] = []  # (when, step) of each logged step from ``after`` on
    reached = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            tail.append(line)
            m = re.search(r"\bstep (\d+)/", line)
            if m and int(m.group(1)) >= after:
                logged.append((time.perf_counter(), int(m.group(1))))
                reached.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + limit
    try:
        while not reached.wait(1.0):
            if proc.poll() is not None:
                raise LookFailed(f"ended (exit {proc.returncode}) before step {after}:\n{''.join(tail)}")
            if time.monotonic() > deadline:
                raise LookFailed(f"had not logged step {after} after {limit:g} s (--limit):\n{''.join(tail)}")
        seen = observe(proc.pid, seconds, work / f"{who}.raw")
        window = [(t, step) for t, step in logged if t <= seen["window_end"]]  # not while the native record paused it
        (t0, s0), (t1, s1) = window[0], window[-1]
        return {**seen, "ms_per_step": (t1 - t0) * 1000 / (s1 - s0) if s1 > s0 else None}
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def observe(pid: int, seconds: float, raw: Path) -> dict[str, Any]:
    """The process's threads' CPU over ``seconds`` (py-spy records its main thread meanwhile), and its set-up; then
    2 s of every thread's C++ frames (after ``window_end``: that record pauses the process)."""
    spy = shutil.which("py-spy")
    before, started = thread_ticks(pid), time.perf_counter()
    children_before, others_before = children_ticks(pid), process_ticks()
    record = subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", "250",
                               "--nonblocking", "--threads", "--format", "raw", "--output", str(raw)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) if spy else None
    time.sleep(seconds)
    after, window_end = thread_ticks(pid), time.perf_counter()
    elapsed = window_end - started
    children = (children_ticks(pid) - children_before) / TICKS / elapsed
    others = busiest_others(others_before, process_ticks(), elapsed, exclude=pid)
    nodes = numa_nodes()
    threads = sorted(({"name": t.name, "cpu": round((t.ticks - before[tid].ticks if tid in before else t.ticks) / TICKS / elapsed, 3),
                       "preempted_per_s": round((t.preempted - before[tid].preempted if tid in before else t.preempted) / elapsed, 1),
                       "last_core": t.core, "numa_node": nodes.get(t.core)} for tid, t in after.items()), key=lambda t: -t["cpu"])
    status = Path(f"/proc/{pid}/status").read_text()
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return {
        "window_end": window_end,
        "threads": threads,
        "threads_line": ", ".join(f"{t['name']} {t['cpu']:.0%} (preempted {t['preempted_per_s']:g}/s, core {t['last_core']})"
                                  for t in threads if t["cpu"] >= 0.02) + f"; children {children:.0%}",
        "others": others,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "children_cpu": round(children, 3),
        "cpus_allowed": re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1),
        "env": sorted(e for e in environ if ENV_KEYS.match(e)),
        **spied(spy, pid, record, raw),
    }


def spied(spy: str | None, pid: int, record: subprocess.Popen | None, raw: Path) -> dict[str, Any]:
    """What py-spy saw: the threads now (``dump``), the main thread's Python functions over the window (``record``,
    finishing), then 2 s of every thread's C++ frames (``record --native``)."""
    if spy is None:
        return {"dump": "(py-spy dump: not installed)", "main_thread_functions": "(py-spy record: not installed)",
                "native_functions": "(py-spy record --native: not installed)"}
    found = {}
    dump = _py_spy([spy, "dump", "--pid", str(pid), "--nonblocking"])
    found["dump"] = dump.stdout if dump.returncode == 0 else f"(py-spy dump: {dump.stderr.strip()[-300:]})"
    try:
        said = record.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        record.kill()
        said = "py-spy record did not end"
    found["main_thread_functions"] = leaf_shares(raw) if raw.exists() else f"(py-spy record: {said.strip()[-300:]})"
    native = raw.with_suffix(".native")  # C++ frames too (the allocator, the driver), every thread: the process pauses
    run = _py_spy([spy, "record", "--pid", str(pid), "--duration", "2", "--rate", "100", "--native", "--threads",
                   "--format", "raw", "--output", str(native)])
    found["native_functions"] = (leaf_shares(native, main_only=False) if native.exists() else
                                 f"(py-spy record --native: {run.stderr.strip()[-300:]})")
    return found


def _py_spy(command: list[str]) -> subprocess.CompletedProcess:
    """A py-spy call, given a minute; one that takes longer is an answer too (a stuck attach), not an exception."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(command, 1, "", f"{command[1]} did not end within 60 s")


class Thread(NamedTuple):
    name: str
    ticks: int  # CPU so far, user + system
    preempted: int  # involuntary context switches so far
    core: int  # the core it last ran on


def thread_ticks(pid: int) -> dict[int, Thread]:
    """Each thread's name, CPU ticks, involuntary context switches and last core."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat, status = (task / "stat").read_text(), (task / "status").read_text()
        except OSError:  # the thread ended
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        switches = re.search(r"nonvoluntary_ctxt_switches:\s*(\d+)", status)
        found[int(task.name)] = Thread(f"{name}[{task.name}]", int(fields[11]) + int(fields[12]),
                                       int(switches.group(1)) if switches else 0, int(fields[36]))
    return found


def process_ticks() -> dict[int, tuple[str, int]]:
    """Every process's name and CPU ticks so far (what else the machine runs)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        found[int(proc.name)] = (stat[stat.index("(") + 1:stat.rindex(")")], int(fields[11]) + int(fields[12]))
    return found


def busiest_others(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], elapsed: float, exclude: int,
                   top: int = 5) -> list[str]:
    """The processes other than ``exclude`` that used the most CPU between the two readings: ``name[pid] 95%``."""
    used = [(name, pid, (ticks - before.get(pid, (name, 0))[1]) / TICKS / elapsed) for pid, (name, ticks) in after.items()
            if pid != exclude]
    return [f"{name}[{pid}] {share:.0%}" for name, pid, share in sorted(used, key=lambda u: -u[2])[:top] if share >= 0.02]


def numa_nodes() -> dict[int, int]:
    """Each core's NUMA node (sysfs; empty where there is none)."""
    nodes = {}
    for node in Path("/sys/devices/system/node").glob("node[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            for part in (node / "cpulist").read_text().strip().split(","):
                first, _, last = part.partition("-")
                for core in range(int(first), int(last or first) + 1):
                    nodes[core] = int(node.name[4:])
    return nodes


def gpu_numa_nodes() -> list[str]:
    """The NUMA node of each NVIDIA device (PCI vendor 0x10de, display class) in sysfs: ``0000:18:00.0 node 0``."""
    found = []
    for device in sorted(Path("/sys/bus/pci/devices").glob("*")):
        with contextlib.suppress(OSError):
            if (device / "vendor").read_text().strip() == "0x10de" and (device / "class").read_text().startswith("0x03"):
                found.append(f"{device.name} node {(device / 'numa_node').read_text().strip()}")
    return found


def children_ticks(pid: int) -> int:
    """CPU ticks of the process's live descendants (torch.compile's workers, a DataLoader's)."""
    total = 0
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12]) + children_ticks(int(child))
    return total


def leaf_shares(raw: Path, top: int = 30, main_only: bool = True) -> list[tuple[str, float, float]]:
    """From py-spy's raw output (``thread (TID): NAME;frame;frame;... count``): the main thread's functions (every
    thread's, ``main_only=False``), with the share of its samples in which each is the innermost frame (where the
    time goes, most first), and the share in which it is on the stack at all."""
    own, on_stack, total = collections.Counter(), collections.Counter(), 0
    lines = [(stack.split(";"), count) for stack, _, count in (line.rpartition(" ") for line in raw.read_text().splitlines())
             if count.isdigit()]
    threads = collections.Counter()
    for frames, count in lines:
        threads[frames[0]] += int(count)
    named = [t for t in threads if "MainThread" in t]  # py-spy names threads where it can; else the busiest thread
    main_thread = named[0] if named else (threads.most_common(1)[0][0] if threads else "")
    for frames, count in lines:
        if (main_only and frames[0] != main_thread) or len(frames) < 2:
            continue
        n, total = int(count), total + int(count)
        functions = [re.sub(r":\d+\)$", ")", frame) for frame in frames[1:]]  # a function, not each of its lines
        own[functions[-1]] += n
        for function in set(functions):
            on_stack[function] += n
    ranked = sorted(on_stack, key=lambda f: (-own[f], -on_stack[f]))[:top]
    return [(f, own[f] / total, on_stack[f] / total) for f in ranked] if total else []


def report(mode: str, found: dict[str, dict[str, Any]], ptrace_scope: str = "") -> str:
    lines = [f"# Why: dlaunch and the hand loop in their steady steps ({mode})", "",
             f"NUMA: {len(set(numa_nodes().values())) or 1} node(s); GPUs {', '.join(gpu_numa_nodes()) or '(none in sysfs)'}", ""]
    if ptrace_scope:
        lines += [f"Yama ptrace_scope: {ptrace_scope} (the runs allow any tracer, so py-spy may attach at 1)", ""]
    for who, seen in found.items():
        if "failed" in seen:
            lines += [f"## {who}", "", "```", seen["failed"][-3000:], "```", ""]
            continue
        functions = seen["main_thread_functions"]
        lines += [f"## {who}", "", f"- ms/step while looked at (logged steps' times): {c.fmt(seen['ms_per_step'])}",
                  f"- threads' CPU (share of a core): {seen['threads_line']}",
                  f"- other processes meanwhile: {', '.join(seen.get('others') or []) or '(none over 2%)'}; "
                  f"load average {' '.join(seen.get('loadavg') or [])}",
                  f"- may run on CPUs {seen['cpus_allowed']}; {len(seen['threads'])} threads",
                  f"- environment: {' '.join(seen['env']) or '(none of note)'}", ""]
        if isinstance(functions, str):
            lines += [functions, ""]
        else:
            lines += ["Main thread, by Python function (py-spy, 250 samples/s):", "",
                      c.markdown_table(["function", "innermost", "on the stack"],
                                       [[f"`{f[:110]}`", f"{own:.1%}", f"{on:.1%}"] for f, own, on in functions]), ""]
        native = seen.get("native_functions", "")
        if isinstance(native, str):
            lines += [native, ""] if native else []
        else:
            lines += ["Every thread, C++ frames included (py-spy --native, 100 samples/s, 2 s):", "",
                      c.markdown_table(["function", "innermost", "on the stack"],
                                       [[f"`{f[:110]}`", f"{own:.1%}", f"{on:.1%}"] for f, own, on in native]), ""]
        lines += ["```", seen["dump"].strip()[:6000], "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
