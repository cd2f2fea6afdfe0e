"""benchmarks/gpu.py's arithmetic, without a GPU: ratios per round then their median, tokens/s, MFU, a subset of modes;
gpu_why.py's look at both loops, on the CPU."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_gpu_benchmark(name: str = "gpu"):
    sys.path.insert(0, str(ROOT / "benchmarks"))  # gpu.py imports its neighbour common.py
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_report_takes_ratios_per_round_and_handles_one_mode():
    gpu = load_gpu_benchmark()
    facts = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0", "bf16_peak_flops": 989.4e12, "params": 19_300_000}
    runs = [{"round": r, "mode": mode, "who": who, "steady_ms_per_step": ms}
            for r, (mine, hand, ahead) in enumerate([(10.0, 9.0, 11.0), (12.0, 12.0, 12.0), (8.0, 10.0, 8.0)])
            for mode, who, ms in (("bf16", "dlaunch", mine), ("bf16", "hand", hand), ("bf16, side stream", "dlaunch", ahead))]
    text = gpu.report(facts, runs, argparse.Namespace(rounds=3, steps=150))
    rows = {tuple(cell.strip() for cell in line.strip("|").split("|")[:2]): line for line in text.splitlines() if line.startswith("|")}
    # per round hand/dlaunch: 0.9, 1.0, 1.25 -> median 1.0 (the median of times, 10 vs 10, would say the same here)
    assert rows[("bf16", "dlaunch")].rstrip("| ").endswith("1.000x")
    tokens_per_s = 64 * 256 / 0.010  # median 10 ms for 16,384 tokens
    assert f"{tokens_per_s:,.0f}" in rows[("bf16", "dlaunch")]
    mfu = gpu.flops_per_token(19_300_000) * tokens_per_s / 989.4e12
    assert f"{mfu:.1%}" in rows[("bf16", "dlaunch")]
    assert ("fp32", "dlaunch") not in rows
    assert "vs dlaunch fp32: **-x**" in text  # fp32 was not run: no speedup is claimed
    # the side stream over the default, per round: 1.1, 1.0, 1.0 -> 1.000
    assert "a bf16 step takes 1.000x the time of the default copy" in text


def test_the_hand_loop_profiles_the_same_window_and_regions_as_dlaunch(tmp_path):
    """gpu_loop.py --profile on the CPU (tiny shape): the table ``gpu.py --profile`` sets beside dlaunch's."""
    import json
    import subprocess

    out = tmp_path / "hand.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_loop.py"), "--device=cpu", "--d-model=16", "--heads=2",
                           "--layers=1", "--context=16", "--batch=4", "--steps=40", f"--out={out}", f"--profile={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "profile" / "hand-ops.txt").read_text()
    assert table.startswith("trainer.profile: steps 33-37 of this command, hand")
    assert "dlaunch.data" in table and "dlaunch.step" in table
    assert json.loads(out.read_text())["steady_ms_per_step"] > 0


def test_a_run_cut_off_after_its_first_round_leaves_that_rounds_results(tmp_path, monkeypatch):
    """A device call has a time limit: the timings of every finished pair of runs are on disk before the next begins.
    The GPU's runs are stood in for by fixed timings (there is no GPU here); the harness around them is gpu.py's own."""
    gpu = load_gpu_benchmark()
    monkeypatch.setattr(gpu.c, "RESULTS", tmp_path)
    monkeypatch.setattr(gpu, "device_facts", lambda: {"gpu": "H100", "torch": "2.11.0", "cuda": "13.0", "bf16_peak_flops": 989.4e12})
    calls = []

    def timed(who):
        def run(extra, steps, work):
            calls.append(who)
            if len(calls) > 3:  # the second round: the call's time limit kills the harness
                raise KeyboardInterrupt
            return {"steady_ms_per_step": 10.0 if who == "dlaunch" else 9.5, "params": 19_300_000}
        return run

    monkeypatch.setattr(gpu, "dlaunch", timed("dlaunch"))
    monkeypatch.setattr(gpu, "hand", timed("hand"))
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--rounds", "3", "--modes", "bf16+compile"])
    try:
        gpu.main()
    except KeyboardInterrupt:
        pass
    (md,) = tmp_path.glob("*-gpu.md")
    text = md.read_text()
    assert "1 (so far) round(s) x 150 steps" in text
    assert "| bf16+compile | dlaunch | 10.00" in text and "0.950x" in text


def test_why_reads_the_main_threads_functions_from_py_spys_raw_stacks(tmp_path):
    why = load_gpu_benchmark("gpu_why")
    raw = tmp_path / "raw.txt"
    raw.write_text("thread (7): MainThread;<module> (loop.py:9);step (loop.py:4);mm (torch/x.py:10) 6\n"
                   "thread (7): MainThread;<module> (loop.py:9);step (loop.py:5);mm (torch/x.py:12) 2\n"
                   "thread (7): MainThread;<module> (loop.py:9);data (loop.py:2) 2\n"
                   "thread (8): pin_memory;loop (torch/pin.py:3) 50\n")  # another thread's samples are not the main's
    shares = {f: (own, on) for f, own, on in why.leaf_shares(raw)}
    assert shares["mm (torch/x.py)"] == (0.8, 0.8)  # two lines of one function count as the function
    assert shares["data (loop.py)"] == (0.2, 0.2)
    assert shares["step (loop.py)"] == (0.0, 0.8) and shares["<module> (loop.py)"] == (0.0, 1.0)
    assert list(shares)[0] == "mm (torch/x.py)"  # most time first


def test_why_looks_at_both_loops_in_their_steady_steps_and_stops_them(tmp_path):
    """gpu_why.py's ``look`` on the CPU (tiny charlm): each run is caught after its step 50, its threads' CPU and
    set-up are read from /proc, and the run, compile workers and all, is gone afterwards."""
    why = load_gpu_benchmark("gpu_why")
    commands = {"dlaunch": why.gpu.dlaunch_command(("trainer.precision=bf16-mixed",), 100_000, tmp_path / "run", why.TINY, 4, "cpu"),
                "hand": why.gpu.hand_command(("--precision", "bf16"), 100_000, tmp_path / "hand.json", why.TINY, 4, "cpu")}
    for who, command in commands.items():
        assert "cluster.device=cpu" in command or "--device=cpu" in command
        seen = why.look(who, command, after=50, seconds=1.0, work=tmp_path)
        assert seen["threads"] and all(t["cpu"] >= 0 and t["preempted_per_s"] >= 0 for t in seen["threads"]), seen
        assert all(t["last_core"] >= 0 for t in seen["threads"]) and isinstance(seen["others"], list)
        assert len(seen["loadavg"]) == 3
        assert seen["cpus_allowed"] and "PYTHONUNBUFFERED=1" in seen["env"]
        assert seen["ms_per_step"] is None or seen["ms_per_step"] > 0  # None: one logged step in the second
        assert isinstance(seen["main_thread_functions"], (str, list)) and seen["dump"]
        assert isinstance(seen["native_functions"], (str, list))
        assert f"## {who}" in why.report("bf16", {who: seen})
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(tmp_path) in _cmdline(p)]
    assert not left, "a looked-at run outlived gpu_why's look"


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_why_stopped_by_a_timeout_takes_its_run_with_it(tmp_path):
    """`.ci/gpu-check next` runs gpu_why under `timeout`, whose SIGTERM reaches gpu_why alone (each run has a session
    of its own): the run it was waiting on trained on through the suite that came next."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gpu_why.py"), "--device=cpu", "--tiny", "--mode=bf16",
                             "--after=100000000", "--limit=600"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (runs := [p for p in Path("/proc").iterdir() if p.name.isdigit() and "launcher.cli.entry" in _cmdline(p)
                            and "--tiny" not in _cmdline(p) and f"{proc.pid}" in _parent_of(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert runs, "gpu_why started no run"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        deadline = time.monotonic() + 30
        while any(r.exists() for r in runs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(r.exists() for r in runs), "gpu_why's run outlived it"
    finally:
        proc.kill()
        proc.wait()


def _parent_of(proc: Path) -> str:
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return ""


def test_the_hand_loop_runs_inside_dlaunch_as_a_script_and_is_reported_beside_the_others(tmp_path):
    """--inside: gpu_loop.py as `dlaunch script=`, in dlaunch's process (the CPU and a tiny shape stand in for the GPU),
    and its row's ratio to the hand loop in the report."""
    import argparse

    gpu = load_gpu_benchmark()
    tiny = {"d_model": 16, "heads": 2, "layers": 1, "context": 16}
    found = gpu.hand_inside(("--precision", "bf16"), 30, tmp_path, tiny, 4, device="cpu")
    assert found["steady_ms_per_step"] > 0 and found["params"] > 0 and set(found["losses"]) == {"1", "30"}
    runs = [{"round": r, "mode": "bf16", "who": who, "steady_ms_per_step": ms}
            for r in range(2) for who, ms in (("dlaunch", 12.6), ("hand", 12.0), (gpu.INSIDE, 12.3))]
    facts = {"gpu": "H200", "torch": "2.11.0", "cuda": "13.0", "bf16_peak_flops": 989.4e12, "params": 19_300_000}
    text = gpu.report(facts, runs, argparse.Namespace(rounds=2, steps=150))
    row = next(line for line in text.splitlines() if f"| {gpu.INSIDE} |" in line)
    assert row.endswith("| 0.976x |"), row  # 12.0 / 12.3
