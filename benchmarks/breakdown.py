"""Where the time goes, for the targets the harness reports as not met (docs/PERFORMANCE.md).

    .venv/bin/python benchmarks/breakdown.py                  # every part
    .venv/bin/python benchmarks/breakdown.py --parts phases --rounds 2 --steps 100

Parts:

* ``phases``: one step split into (loop + data), forward, backward (for DDP:
  with the gradient all-reduce it overlaps and then waits for), optimizer; the
  baselines with ``--phases``, dlaunch with ``benchmarks/profiled_recipe.py``
  (the same work in manual mode, timed). Interleaved rounds; medians of steps 20 on.
* ``knobs``: dlaunch mirrored 1x2 with the settings dlaunch already offers
  (bucket size, gradient_as_bucket_view, input prefetch), each paired with
  hand-written DDP in the same round.
* ``reduce``: ``strategy.reduce`` of 7.45 MB across 2 processes taken apart:
  the shape check, the copies, a fresh buffer vs a reused one, the all-reduce.
* ``dataset``: cProfile of one epoch of each input pipeline on rank 0 of 2.
* ``launch``: the pieces of ``dlaunch ... strategy=mirrored cluster=1x2 trainer.steps=1``:
  the interpreter, ``import torch``, the CLI's imports, a dry run (compose,
  validate, plan: the parent's work before it starts anything), a worker's
  imports, and the whole command; next to ``torchrun`` on the trivial script.
* ``rounding``: how far last-bit differences carry in this workload: the plain
  loop as is, with the initial weights of the first layer scaled by (1 + 1e-7),
  and with each global batch's gradient summed as two halves (dlaunch's 2-replica
  split); losses every 40 steps. Why final losses of variants that split a
  batch differently agree only to ~1e-2 relative at step 200.

Writes ``benchmarks/results/TIMESTAMP-breakdown.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402
from rounding import bench_rounding  # noqa: E402

WARMUP = 19
PHASE_NAMES = ("loop + data", "forward", "backward (+ grad sync)", "optimizer")
PROFILED = str(c.HERE / "profiled_recipe.py")


# ----- phases -----

PHASE_VARIANTS = (
    ("plain loop (1 x 2 threads)", "plain", 2, ()),
    ("dlaunch one_device", "dlaunch", 2, ("strategy=one_device",)),
    ("hand-written DDP (2 x 1)", "ddp", 1, ()),
    ("DDP, sync off", "ddp", 1, ("--no-sync",)),
    ("dlaunch mirrored 1x2", "dlaunch", 1, ("strategy=mirrored", "cluster=1x2")),
    ("dlaunch multi_worker_mirrored 2x1", "dlaunch", 1, ("strategy=multi_worker_mirrored", "cluster=2x1")),
)


def _phase_command(kind: str, threads: int, args: tuple[str, ...], steps: int, work: Path) -> list[str]:
    out = str(work / "result.json")
    if kind == "plain":
        return [sys.executable, str(c.HERE / "plain_loop.py"), "--steps", str(steps), "--threads", str(threads), "--phases", "--out", out]
    if kind == "ddp":
        return [str(c.BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(c.HERE / "ddp_baseline.py"),
                "--steps", str(steps), "--threads", str(threads), "--phases", "--out", out, *args]
    return [str(c.BIN / "dlaunch"), "recipe=bench_mlp", f"recipe.entry={PROFILED}", f"trainer.steps={steps}", *args,
            f"hydra.run.dir={work / 'run'}"]


def _run(cmd: list[str], threads: int, work: Path, quiet_wait: float, **env: str) -> dict[str, Any]:
    quiet = c.wait_for_quiet(quiet_wait)
    with c.CpuWatch() as cpu:
        proc = subprocess.run(cmd, cwd=c.ROOT, env=c.clean_env(OMP_NUM_THREADS=str(threads), **env),
                              capture_output=True, text=True, timeout=600)
    return {"rc": proc.returncode, "other_cores": cpu.other_cores, "stderr_tail": proc.stderr[-1500:] if proc.returncode else "", **quiet}


def _phase_medians(phases: list[list[float]]) -> list[float | None]:
    steady = phases[WARMUP:]
    return [c.median(p[i] * 1000 for p in steady) for i in range(4)]


def bench_phases(rounds: int, steps: int, quiet_wait: float) -> dict[str, Any]:
    samples: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in PHASE_VARIANTS}
    with tempfile.TemporaryDirectory(prefix="dlaunch-profile-") as tmp:
        for r in range(rounds):
            for label, kind, threads, args in PHASE_VARIANTS:
                work = Path(tmp) / f"{r}-{len(samples[label])}-{kind}-{abs(hash(label))}"
                work.mkdir()
                rec = _run(_phase_command(kind, threads, args, steps, work), threads, work, quiet_wait, BENCH_PHASES_DIR=str(work))
                try:
                    if kind == "dlaunch":
                        phases = json.loads((work / "phases-0.json").read_text())
                        rec["step_ms"] = json.loads((work / "run" / "summary.json").read_text())["steady_ms_per_step"]
                    else:
                        data = json.loads((work / "result.json").read_text())
                        phases = data["phases"]
                        rec["step_ms"] = c.median(s * 1000 for s in data["step_seconds"][WARMUP:])
                    rec["phases_ms"] = _phase_medians(phases)
                except (OSError, ValueError, KeyError) as exc:
                    rec["error"] = f"{type(exc).__name__}: {exc}"
                samples[label].append(rec)
                print(f"  phases round {r + 1}/{rounds}  {label:<36} step {c.fmt(rec.get('step_ms'))} ms  "
                      f"phases {[round(p, 2) if p else p for p in rec.get('phases_ms', [])]}  others {c.fmt(rec['other_cores'])}", flush=True)
    out = {}
    for label, runs in samples.items():
        ok = [r for r in runs if "phases_ms" in r]
        out[label] = {"step_ms": c.median(r["step_ms"] for r in ok),
                      "phases_ms": {name: c.median(r["phases_ms"][i] for r in ok) for i, name in enumerate(PHASE_NAMES)},
                      "other_cores": c.median(r["other_cores"] for r in runs), "runs_ok": len(ok), "runs": runs}
    return out


# ----- knobs for mirrored -----

KNOBS = (
    ("defaults (25 MB buckets, gradient_as_bucket_view=true, prefetch 1)", ()),
    ("strategy.bucket_cap_mb=1", ("strategy.bucket_cap_mb=1",)),
    ("strategy.bucket_cap_mb=100 (one bucket)", ("strategy.bucket_cap_mb=100",)),
    ("strategy.gradient_as_bucket_view=false", ("strategy.gradient_as_bucket_view=false",)),
    ("input.prefetch=0", ("input.prefetch=0",)),
)


def bench_knobs(rounds: int, steps: int, quiet_wait: float) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = {"hand-written DDP": [], **{label: [] for label, _ in KNOBS}}
    with tempfile.TemporaryDirectory(prefix="dlaunch-knobs-") as tmp:
        for r in range(rounds):
            work = Path(tmp) / f"ddp-{r}"
            work.mkdir()
            cmd = [str(c.BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(c.HERE / "ddp_baseline.py"),
                   "--steps", str(steps), "--out", str(work / "result.json")]
            rec = _run(cmd, 1, work, quiet_wait)
            try:
                data = json.loads((work / "result.json").read_text())
                rec["step_ms"] = c.median(s * 1000 for s in data["step_seconds"][WARMUP:])
            except (OSError, ValueError, KeyError) as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
            rows["hand-written DDP"].append(rec)
            ddp_ms = rec.get("step_ms")
            print(f"  knobs round {r + 1}/{rounds}  {'hand-written DDP':<70} {c.fmt(ddp_ms)} ms", flush=True)
            for i, (label, overrides) in enumerate(KNOBS):
                work = Path(tmp) / f"k{i}-{r}"
                work.mkdir()
                cmd = [str(c.BIN / "dlaunch"), "recipe=bench_mlp", f"trainer.steps={steps}", "strategy=mirrored", "cluster=1x2",
                       *overrides, f"hydra.run.dir={work / 'run'}"]
                rec = _run(cmd, 1, work, quiet_wait)
                try:
                    rec["step_ms"] = json.loads((work / "run" / "summary.json").read_text())["steady_ms_per_step"]
                    rec["vs_ddp"] = rec["step_ms"] / ddp_ms if ddp_ms else None
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    rec["error"] = f"{type(exc).__name__}: {exc}"
                rows[label].append(rec)
                print(f"  knobs round {r + 1}/{rounds}  {label:<70} {c.fmt(rec.get('step_ms'))} ms  "
                      f"({c.fmt(rec.get('vs_ddp'), 3)}x DDP)  others {c.fmt(rec['other_cores'])}", flush=True)
    return {label: {"step_ms": c.median(r.get("step_ms") for r in runs), "vs_ddp": c.median(r.get("vs_ddp") for r in runs),
                    "runs": runs} for label, runs in rows.items()}


# ----- strategy.reduce taken apart -----

def _reduce_parts_worker(numel: int, iters: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from launcher.distribute import MirroredStrategy, ReduceOp

    torch.set_num_threads(1)
    strategy = MirroredStrategy()
    ext = strategy.extended
    value = torch.ones(numel)
    per_replica = strategy.experimental_distribute_values_from_function(lambda ctx: value)
    reused = value.clone()

    def fresh_all_reduce() -> None:
        buffer = torch.empty(numel)
        buffer.fill_(1.0)
        dist.all_reduce(buffer)

    cases = {
        "dist.all_reduce, reused buffer": lambda: dist.all_reduce(reused),
        "dist.all_reduce, fresh buffer each call": fresh_all_reduce,
        "torch.empty + fill_ (a fresh 7.45 MB buffer)": lambda: torch.empty(numel).fill_(1.0),
        "clone (a copy into a fresh buffer)": lambda: value.clone(),
        "shape check (2 tiny all_reduces)": lambda: ext._check_same_shapes([value]),
        "strategy.reduce SUM": lambda: strategy.reduce(ReduceOp.SUM, per_replica, axis=None),
    }
    out = {}
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        reused.fill_(1.0)
        dist.barrier()
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        out[name] = sorted(samples)[len(samples) // 2] * 1000
    return out


def bench_reduce(iters: int) -> dict[str, Any]:
    from launcher.launch.function import run_function

    return run_function(_reduce_parts_worker, nproc=2, args=(1_863_690, iters), timeout_s=300)[0]


# ----- input pipelines under cProfile -----

def _dataset_profile_worker(examples: int) -> dict[str, str]:
    import cProfile
    import io
    import pstats

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from launcher.distribute import MirroredStrategy
    from launcher.input.position import EpochBatchSampler

    torch.set_num_threads(1)
    strategy = MirroredStrategy()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = TensorDataset(torch.randn(examples, 784), torch.randint(0, 10, (examples,)))

    def dlaunch_epoch() -> None:
        for _ in strategy.experimental_distribute_dataset(DataLoader(data, batch_sampler=EpochBatchSampler(examples, 256, True, 0))):
            pass

    def torch_epoch() -> None:
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
        for _ in DataLoader(data, batch_size=256 // world, sampler=sampler, drop_last=True):
            pass

    out = {}
    for name, fn in (("experimental_distribute_dataset", dlaunch_epoch), ("DataLoader + DistributedSampler", torch_epoch)):
        fn()
        dist.barrier()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        fn()
        prof.disable()
        wall = time.perf_counter() - t0
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
        out[name] = f"wall under cProfile {wall:.3f} s\n" + text.getvalue()
    return out


def bench_dataset(examples: int) -> dict[str, str]:
    from launcher.launch.function import run_function

    return run_function(_dataset_profile_worker, nproc=2, args=(examples,), timeout_s=300)[0]


# ----- launch, taken apart -----

LAUNCH_PIECES = (
    ("python -c pass", [sys.executable, "-c", "pass"]),
    ("python -c 'import torch'", [sys.executable, "-c", "import torch"]),
    ("python -c 'import torch.distributed.run' (torchrun's module)", [sys.executable, "-c", "import torch.distributed.run"]),
    ("python -c 'import launcher.cli.main' (dlaunch's entry)", [sys.executable, "-c", "import launcher.cli.main"]),
    ("python -c 'import launcher.runtime.worker' (a worker's imports)", [sys.executable, "-c", "import launcher.runtime.worker"]),
    ("dlaunch ... launch.dry_run=true (compose, validate, plan)",
     [str(c.BIN / "dlaunch"), "recipe=linear", "trainer.steps=1", "strategy=mirrored", "cluster=1x2", "launch.dry_run=true"]),
    ("dlaunch recipe=linear trainer.steps=1 strategy=mirrored cluster=1x2",
     [str(c.BIN / "dlaunch"), "recipe=linear", "trainer.steps=1", "strategy=mirrored", "cluster=1x2"]),
    ("torchrun --nproc_per_node 2 trivial.py",
     [str(c.BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(c.HERE / "trivial.py"), "out.json"]),
)


def bench_launch(rounds: int, quiet_wait: float) -> dict[str, Any]:
    walls: dict[str, list[float]] = {label: [] for label, _ in LAUNCH_PIECES}
    with tempfile.TemporaryDirectory(prefix="dlaunch-launch-") as tmp:
        for r in range(rounds):
            for label, cmd in LAUNCH_PIECES:
                work = Path(tmp) / f"{r}-{len(walls[label])}-{abs(hash(label))}"
                work.mkdir()
                cmd = [*cmd, f"hydra.run.dir={work / 'run'}"] if "dlaunch" in cmd[0] else cmd
                c.wait_for_quiet(quiet_wait)
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, cwd=work, env=c.clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
                if proc.returncode == 0:
                    walls[label].append(time.perf_counter() - t0)
                print(f"  launch round {r + 1}/{rounds}  {label:<70} {time.perf_counter() - t0:.2f} s  rc {proc.returncode}", flush=True)
    return {label: {"wall_s": c.median(v), "spread": c.spread(v)} for label, v in walls.items()}


# ----- report -----

def render(result: dict[str, Any]) -> str:
    out = [f"# where the time goes ({result['started']})", ""]
    if "phases" in result:
        out += ["## One step, split (ms, medians of steps 20 on, then of rounds)", "", c.markdown_table(
            ["variant", "step", *PHASE_NAMES, "other procs (cores)"],
            [[label, c.fmt(r["step_ms"]), *[c.fmt(r["phases_ms"][n]) for n in PHASE_NAMES], c.fmt(r["other_cores"])]
             for label, r in result["phases"].items()]), ""]
    if "knobs" in result:
        out += ["## dlaunch mirrored 1x2: settings tried, each paired with DDP in its round", "", c.markdown_table(
            ["setting", "ms/step (median)", "vs DDP (median of rounds)"],
            [[label, c.fmt(r["step_ms"]), c.fmt(r["vs_ddp"], 3)] for label, r in result["knobs"].items()]), ""]
    if "reduce" in result:
        out += ["## strategy.reduce of 7.45 MB, 2 processes, taken apart (ms, median)", "", c.markdown_table(
            ["operation", "ms"], [[k, c.fmt(v)] for k, v in result["reduce"].items()]), ""]
    if "rounding" in result:
        runs = result["rounding"]
        base = runs["as is"]
        out += ["## How far last-bit differences carry (plain loop, loss every 40 steps)", "", c.markdown_table(
            ["run", *[f"step {40 * (i + 1)}" for i in range(len(base))], "max relative difference from 'as is'"],
            [[name, *[f"{v:.6f}" for v in vals], f"{max(abs(a - b) / abs(b) for a, b in zip(vals, base)):.2g}"]
             for name, vals in runs.items()]), ""]
    if "launch" in result:
        out += ["## Launch, taken apart (wall s, median)", "", c.markdown_table(
            ["command", "wall (s)", "min-max"],
            [[k, c.fmt(v["wall_s"]), f"{c.fmt(v['spread']['min'])}-{c.fmt(v['spread']['max'])}"] for k, v in result["launch"].items()]), ""]
    if "dataset" in result:
        for name, text in result["dataset"].items():
            out += [f"## cProfile, one epoch, rank 0: {name}", "", "```", text.strip(), "```", ""]
    return "\n".join(out)


PARTS = ("phases", "knobs", "reduce", "dataset", "launch", "rounding")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Profile where dlaunch's time goes vs hand-written torch.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--quiet-wait", type=float, default=30.0)
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    result: dict[str, Any] = {"started": c.timestamp(), "machine": c.machine(), "rounds": args.rounds, "steps": args.steps}
    if "phases" in parts:
        result["phases"] = bench_phases(args.rounds, args.steps, args.quiet_wait)
    if "knobs" in parts:
        result["knobs"] = bench_knobs(args.rounds, args.steps, args.quiet_wait)
    if "reduce" in parts:
        c.wait_for_quiet(args.quiet_wait)
        result["reduce"] = bench_reduce(iters=30)
    if "dataset" in parts:
        c.wait_for_quiet(args.quiet_wait)
        result["dataset"] = bench_dataset(65_536)
    if "launch" in parts:
        result["launch"] = bench_launch(args.rounds, args.quiet_wait)
    if "rounding" in parts:
        result["rounding"] = bench_rounding(args.steps)
    text = render(result)
    c.publish(result["started"] + "-breakdown", result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
