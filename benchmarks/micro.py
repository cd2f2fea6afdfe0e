"""Micro-benchmarks (issue 8): dlaunch's pieces against the raw torch they stand on.

    make bench                                  # run.py, then this
    .venv/bin/python benchmarks/micro.py        # every part, default repetitions
    .venv/bin/python benchmarks/micro.py --quick
    .venv/bin/python benchmarks/micro.py --parts run,reduce

Parts:

* ``run``: ``strategy.run`` per call on a trivial function, ``MirroredStrategy``
  with 2 local replicas (``devices=["cpu:0", "cpu:1"]``, replica threads) and with 1;
  next to a plain Python call and a bare thread hand-off (``queue.SimpleQueue``
  there and back), the floor for any 2-thread dispatch.
* ``reduce``: ``strategy.reduce`` of a 7.45 MB fp32 tensor (1,863,690 elements,
  the bench_mlp gradient) across 2 processes (``run_function``, gloo) vs raw
  ``dist.all_reduce`` of the same tensor, SUM and MEAN, interleaved: with the
  default op (shared memory between the processes of one machine) and with the
  plain all-reduce (``NcclAllReduce``: gloo, like the raw rows).
* ``dataset``: one epoch of ``strategy.experimental_distribute_dataset`` over a
  ``DataLoader`` of a map-style dataset (65,536 x 784, dlaunch's ``EpochBatchSampler``,
  global batch 256) vs ``DataLoader`` + ``DistributedSampler`` (batch 128 per
  process) on the same dataset, 2 processes, interleaved.
* ``launch``: from the command's start to the end of the first step, and wall,
  for ``dlaunch recipe=linear trainer.steps=1`` (1x1, and mirrored 1x2) vs
  ``torchrun`` running ``benchmarks/trivial.py`` (1 and 2 processes), plus
  ``python -c "import torch"``; interleaved rounds.

Writes ``benchmarks/results/TIMESTAMP-micro.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402

NUMEL = 1_863_690  # bench_mlp's parameters: 7.45 MB in fp32
EXAMPLES, FEATURES, GLOBAL_BATCH = 65_536, 784, 256


# ----- strategy.run -----

def _trivial() -> int:
    return 1


def bench_run(calls: int, repeats: int) -> dict[str, Any]:
    import queue
    import threading

    from launcher.distribute import MirroredStrategy

    def per_call_us(fn: Any) -> list[float]:
        for _ in range(min(calls, 200)):
            fn()
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - t0) / calls * 1e6)
        return out

    results: dict[str, Any] = {}
    results["python call"] = per_call_us(_trivial)

    inbox, done = queue.SimpleQueue(), queue.SimpleQueue()

    def serve() -> None:
        while (job := inbox.get()) is not None:
            done.put(job())

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()

    def hand_off() -> None:  # what 2 replicas need at least: give one job to a thread, run one here, wait for it
        inbox.put(_trivial)
        _trivial()
        done.get()

    results["thread hand-off (SimpleQueue, 2 threads)"] = per_call_us(hand_off)
    inbox.put(None)
    worker.join()
    for n in (1, 2):
        strategy = MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)], env=None)
        results[f"strategy.run, {n} local replica(s)"] = per_call_us(lambda: strategy.run(_trivial))
        if strategy.extended._threads is not None:
            strategy.extended._threads.close()
    return {name: {"per_call_us": c.median(v), "spread": c.spread(v), "samples": v} for name, v in results.items()}


# ----- strategy.reduce vs all_reduce -----

def _reduce_worker(numel: int, iters: int, repeats: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    from launcher.distribute import MirroredStrategy, NcclAllReduce, ReduceOp

    torch.set_num_threads(1)
    strategy = MirroredStrategy()  # one replica per process, the group from run_function's environment; shared memory
    on_gloo = MirroredStrategy(cross_device_ops=NcclAllReduce())  # the plain all-reduce: gloo, as the raw rows
    world = dist.get_world_size()
    value = torch.ones(numel)
    per_replica = strategy.experimental_distribute_values_from_function(lambda ctx: value)
    raw = value.clone()

    def raw_sum() -> None:
        dist.all_reduce(raw)

    def raw_mean() -> None:
        dist.all_reduce(raw)
        raw.div_(world)

    cases = {
        "all_reduce SUM (raw)": raw_sum,
        "strategy.reduce SUM": lambda: strategy.reduce(ReduceOp.SUM, per_replica, axis=None),
        "all_reduce + div_ (raw MEAN)": raw_mean,
        "strategy.reduce MEAN": lambda: strategy.reduce(ReduceOp.MEAN, per_replica, axis=None),
        "strategy.reduce SUM, gloo (cross_device_ops=nccl_all_reduce)": lambda: on_gloo.reduce(ReduceOp.SUM, per_replica, axis=None),
        "strategy.reduce MEAN, gloo (cross_device_ops=nccl_all_reduce)": lambda: on_gloo.reduce(ReduceOp.MEAN, per_replica, axis=None),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up
        for _ in range(3):
            fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            raw.fill_(1.0)  # keep the values finite
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times[name].append((time.perf_counter() - t0) / iters)
    return times


def bench_reduce(iters: int, repeats: int) -> dict[str, Any]:
    from launcher.launch.function import run_function

    out = run_function(_reduce_worker, nproc=2, args=(NUMEL, iters, repeats), timeout_s=300)
    times = out[0]  # rank 0's clock; rank 1's agrees to within the barrier
    nbytes = NUMEL * 4
    return {name: {"ms": c.median(v) * 1e3, "spread_ms": c.spread([x * 1e3 for x in v]),
                   "GB_per_s": nbytes / c.median(v) / 1e9, "samples_s": v} for name, v in times.items()}


# ----- distributed dataset vs DataLoader + DistributedSampler -----

def _dataset_worker(examples: int, repeats: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from launcher.distribute import MirroredStrategy
    from launcher.input.position import EpochBatchSampler

    torch.set_num_threads(1)
    strategy = MirroredStrategy()
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(examples, FEATURES, generator=g), torch.randint(0, 10, (examples,), generator=g))

    def dlaunch_epoch(seed: int) -> int:
        loader = DataLoader(data, batch_sampler=EpochBatchSampler(examples, GLOBAL_BATCH, True, seed))
        rows = 0
        for batch in strategy.experimental_distribute_dataset(loader):
            x, _ = strategy.experimental_local_results(batch)[0]
            rows += x.shape[0]
        return rows

    def torch_epoch(seed: int) -> int:
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
        rows = 0
        for x, _ in DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler, drop_last=True):
            rows += x.shape[0]
        return rows

    cases = {"experimental_distribute_dataset": dlaunch_epoch, "DataLoader + DistributedSampler": torch_epoch}
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn(99)  # warm-up
    for r in range(repeats):
        for name, fn in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            rows = fn(r)
            rates[name].append(rows / (time.perf_counter() - t0))  # this process's examples per second
    return rates


def bench_dataset(examples: int, repeats: int) -> dict[str, Any]:
    from launcher.launch.function import run_function

    out = run_function(_dataset_worker, nproc=2, args=(examples, repeats), timeout_s=600)
    return {name: {"examples_per_s_per_process": c.median(v), "spread": c.spread(v),
                   "rank1_median": c.median(out[1][name]), "samples": v} for name, v in out[0].items()}


# ----- launch overhead -----

LAUNCHES = (
    ("import torch", "import"),
    ("torchrun, 1 process, trivial.py", "torchrun1"),
    ("dlaunch recipe=linear trainer.steps=1 (1x1)", "dlaunch1"),
    ("torchrun, 2 processes, trivial.py", "torchrun2"),
    ("dlaunch recipe=linear trainer.steps=1 strategy=mirrored cluster=1x2", "dlaunch2"),
)


def _launch_command(kind: str, work: Path) -> list[str]:
    out = str(work / "out.json")
    if kind == "import":
        return [sys.executable, "-c", "import torch"]
    if kind.startswith("torchrun"):
        return [str(c.BIN / "torchrun"), "--standalone", "--nproc_per_node", kind[-1], str(c.HERE / "trivial.py"), out]
    extra = ["strategy=mirrored", "cluster=1x2"] if kind == "dlaunch2" else []
    return [str(c.BIN / "dlaunch"), "recipe=linear", "trainer.steps=1", *extra, f"hydra.run.dir={work / 'run'}"]


def _first_step_time(kind: str, work: Path) -> float | None:
    if kind == "import":
        return None
    if kind.startswith("torchrun"):
        return json.loads((work / "out.json").read_text())["first_step_time"]
    return json.loads((work / "run" / "metrics.jsonl").read_text().splitlines()[0])["time"]


def bench_launch(rounds: int, quiet_wait_s: float) -> dict[str, Any]:
    samples: dict[str, list[dict[str, Any]]] = {kind: [] for _, kind in LAUNCHES}
    with tempfile.TemporaryDirectory(prefix="dlaunch-launch-") as tmp:
        for r in range(rounds):
            for label, kind in LAUNCHES:
                work = Path(tmp) / f"{kind}-{r}"
                work.mkdir()
                quiet = c.wait_for_quiet(quiet_wait_s)
                with c.CpuWatch() as cpu:
                    started_wall, started = time.time(), time.perf_counter()
                    proc = subprocess.run(_launch_command(kind, work), cwd=work, env=c.clean_env(OMP_NUM_THREADS="1"),
                                          capture_output=True, text=True, timeout=300)
                    wall = time.perf_counter() - started
                rec: dict[str, Any] = {"round": r, "rc": proc.returncode, "wall_s": wall, "other_cores": cpu.other_cores, **quiet}
                if proc.returncode != 0:
                    rec["stderr_tail"] = proc.stderr[-1500:]
                try:
                    first = _first_step_time(kind, work)
                    rec["first_step_s"] = None if first is None else first - started_wall
                except (OSError, ValueError, KeyError, IndexError) as exc:
                    rec.update(first_step_s=None, error=f"{type(exc).__name__}: {exc}", stderr_tail=proc.stderr[-1500:])
                samples[kind].append(rec)
                print(f"  launch round {r + 1}/{rounds}  {label:<70} first step {c.fmt(rec['first_step_s'])} s  "
                      f"wall {wall:.2f} s  others {c.fmt(cpu.other_cores)}  rc {proc.returncode}", flush=True)
    out: dict[str, Any] = {}
    for label, kind in LAUNCHES:
        ok = [s for s in samples[kind] if s["rc"] == 0]
        out[kind] = {"label": label, "first_step_s": c.median(s["first_step_s"] for s in ok),
                     "wall_s": c.median(s["wall_s"] for s in ok), "wall_spread": c.spread(s["wall_s"] for s in ok),
                     "runs_ok": len(ok), "runs": len(samples[kind]), "samples": samples[kind]}
    for num, den in (("dlaunch1", "torchrun1"), ("dlaunch2", "torchrun2")):
        for metric in ("first_step_s", "wall_s"):
            per_round = [a[metric] / b[metric] for a, b in zip(samples[num], samples[den])
                         if a["rc"] == 0 and b["rc"] == 0 and a[metric] and b[metric]]
            out[f"{num}/{den} {metric}"] = {"median": c.median(per_round), "spread": c.spread(per_round), "per_round": per_round}
    return out


# ----- report -----

def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    if "run" in result:
        us = result["run"]["strategy.run, 2 local replica(s)"]["per_call_us"]
        rows.append({"target": "strategy.run, 2 local replicas: < 50 us per call", "measured": f"{us:.1f} us", "met": us < 50})
    if "reduce" in result:
        red = result["reduce"]
        for op, raw in (("SUM", "all_reduce SUM (raw)"), ("MEAN", "all_reduce + div_ (raw MEAN)")):
            ratio = red[f"strategy.reduce {op}"]["GB_per_s"] / red[raw]["GB_per_s"]
            rows.append({"target": f"strategy.reduce {op} 7.45 MB, 2 processes: >= 0.9x raw bandwidth",
                         "measured": f"{ratio:.2f}x", "met": ratio >= 0.9})
            gloo = red[f"strategy.reduce {op}, gloo (cross_device_ops=nccl_all_reduce)"]["GB_per_s"] / red[raw]["GB_per_s"]
            rows.append({"target": f"strategy.reduce {op} through gloo itself (cross_device_ops=nccl_all_reduce): >= 0.9x raw",
                         "measured": f"{gloo:.2f}x", "met": gloo >= 0.9})
    if "dataset" in result:
        d = result["dataset"]
        ratio = d["experimental_distribute_dataset"]["examples_per_s_per_process"] / d["DataLoader + DistributedSampler"]["examples_per_s_per_process"]
        rows.append({"target": "distributed dataset: >= 0.95x DataLoader + DistributedSampler", "measured": f"{ratio:.2f}x", "met": ratio >= 0.95})
    if "launch" in result:
        la = result["launch"]
        for num, den, what in (("dlaunch1", "torchrun1", "1 process"), ("dlaunch2", "torchrun2", "2 processes")):
            ratio = la[f"{num}/{den} first_step_s"]["median"]
            rows.append({"target": f"launch to first step, {what}: at most torchrun's",
                         "measured": f"{c.fmt(la[num]['first_step_s'])} s vs {c.fmt(la[den]['first_step_s'])} s ({c.fmt(ratio, 2)}x)",
                         "met": None if ratio is None else ratio <= 1.0})
    return rows


def render(result: dict[str, Any]) -> str:
    m = result["machine"]
    out = [f"# micro-benchmarks ({result['started']})", "",
           f"Machine: {m['nproc']} CPUs ({m['cpu_model']}), torch {m['torch']}, Python {m['python']}.", ""]
    if "run" in result:
        out += ["## strategy.run per call (trivial function)", "", c.markdown_table(
            ["call", "us per call (median)", "min-max"],
            [[name, c.fmt(r["per_call_us"], 1), f"{c.fmt(r['spread']['min'], 1)}-{c.fmt(r['spread']['max'], 1)}"]
             for name, r in result["run"].items()]), ""]
    if "reduce" in result:
        out += ["## 7.45 MB fp32 across 2 processes (gloo)", "", c.markdown_table(
            ["operation", "ms (median)", "min-max ms", "GB/s (size / time)"],
            [[name, c.fmt(r["ms"]), f"{c.fmt(r['spread_ms']['min'])}-{c.fmt(r['spread_ms']['max'])}", c.fmt(r["GB_per_s"])]
             for name, r in result["reduce"].items()]), ""]
    if "dataset" in result:
        out += ["## Distributed input, 2 processes, one epoch of 65,536 x 784 (global batch 256)", "", c.markdown_table(
            ["pipeline", "examples/s per process (median)", "min-max", "rank 1 median"],
            [[name, c.fmt(r["examples_per_s_per_process"], 0),
              f"{c.fmt(r['spread']['min'], 0)}-{c.fmt(r['spread']['max'], 0)}", c.fmt(r["rank1_median"], 0)]
             for name, r in result["dataset"].items()]), ""]
    if "launch" in result:
        la = result["launch"]
        out += ["## Launch overhead (trivial work)", "", c.markdown_table(
            ["command", "start to end of step 1 (s)", "wall (s)", "wall min-max", "runs ok"],
            [[r["label"], c.fmt(r["first_step_s"]), c.fmt(r["wall_s"]),
              f"{c.fmt(r['wall_spread']['min'])}-{c.fmt(r['wall_spread']['max'])}", f"{r['runs_ok']}/{r['runs']}"]
             for k, r in la.items() if "label" in r]), ""]
    out += ["## Targets", "", c.markdown_table(["target", "measured", "met"],
                                                 [[t["target"], t["measured"], c.fmt(t["met"])] for t in result["targets"]])]
    if result.get("others"):
        out += ["", "Other processes' load (cores) sampled before each part: "
                + ", ".join(f"{k} {c.fmt(v)}" for k, v in result["others"].items()) + "."]
    return "\n".join(out)


PARTS = ("run", "reduce", "dataset", "launch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="dlaunch micro-benchmarks vs raw torch.")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, a smaller dataset, 1 launch round")
    parser.add_argument("--rounds", type=int, default=None, help="launch rounds (default 5; --quick: 1)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    parser.add_argument("--quiet-wait", type=float, default=30.0,
                        help="seconds to wait, before each part or launch, for other processes to use < 0.3 cores")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if any(p not in PARTS for p in parts):
        parser.error(f"--parts: choose from {PARTS}")
    rounds = args.rounds or (1 if args.quick else 5)
    result: dict[str, Any] = {"started": c.timestamp(), "machine": c.machine(), "quick": args.quick, "others": {}}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "run" in parts:
        result["others"]["run"] = c.wait_for_quiet(args.quiet_wait)["others_before"]
        print("strategy.run per call ...", flush=True)
        result["run"] = bench_run(calls=2000 if args.quick else 20000, repeats=3 if args.quick else 7)
    if "reduce" in parts:
        result["others"]["reduce"] = c.wait_for_quiet(args.quiet_wait)["others_before"]
        print("strategy.reduce vs all_reduce, 2 processes ...", flush=True)
        result["reduce"] = bench_reduce(iters=5 if args.quick else 20, repeats=3 if args.quick else 7)
    if "dataset" in parts:
        result["others"]["dataset"] = c.wait_for_quiet(args.quiet_wait)["others_before"]
        print("distributed dataset vs DataLoader + DistributedSampler, 2 processes ...", flush=True)
        result["dataset"] = bench_dataset(EXAMPLES // 4 if args.quick else EXAMPLES, repeats=2 if args.quick else 5)
    if "launch" in parts:
        print("launch overhead ...", flush=True)
        result["launch"] = bench_launch(rounds, args.quiet_wait)
    result["targets"] = targets(result)
    text = render(result)
    c.publish(result["started"] + "-micro", result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
