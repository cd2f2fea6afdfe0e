"""The benchmark harness (issue 8): the bench_mlp workload through dlaunch and hand-written torch, interleaved.

    make bench                                        # this, then micro.py
    .venv/bin/python benchmarks/run.py                # 5 rounds x 200 steps of every variant
    .venv/bin/python benchmarks/run.py --quick        # 1 round x 40 steps: is everything wired?
    .venv/bin/python benchmarks/run.py --rounds 7 --variants ddp,mirrored

Each round runs every variant once, in a fixed order (A B C ... A B C ...), so
slow drifts of the machine hit every variant alike. Per run it records the
median wall time per step from step 20 on (steady state), the time from the
command's start to the end of step 1, the whole command's wall time, the final
loss, and how many cores other processes kept busy meanwhile. Ratios against
the hand-written baselines are taken within each round, then their median.

Thread settings: 2 torch threads for a single process with one replica,
1 per replica otherwise (``OMP_NUM_THREADS``; dlaunch's workers inherit it, the
baselines also call ``torch.set_num_threads``).

Writes ``benchmarks/results/TIMESTAMP.json`` (every run) and ``TIMESTAMP.md`` (the tables).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402

GLOBAL_BATCH = 256
WARMUP = 19  # steady state: step 20 on (index 19 on)


@dataclasses.dataclass(frozen=True)
class Variant:
    key: str
    label: str
    kind: str  # plain | ddp | dlaunch
    threads: int  # OMP_NUM_THREADS: per process
    args: tuple[str, ...] = ()
    synchronous: bool = True  # its final loss must agree with the others'


VARIANTS = (
    Variant("plain", "plain loop, 1 process x 2 threads", "plain", 2),
    Variant("ddp", "hand-written DDP, torchrun 2 x 1 thread", "ddp", 1),
    Variant("ddp_nosync", "DDP, gradient sync off (compute floor)", "ddp", 1, ("--no-sync",), synchronous=False),
    Variant("ddp_contiguous", "DDP, dlaunch's batch layout (loss check)", "ddp", 1, ("--layout", "contiguous")),
    Variant("one_device", "dlaunch one_device (1 x 2 threads)", "dlaunch", 2, ("strategy=one_device",)),
    Variant("mirrored", "dlaunch mirrored 1x2", "dlaunch", 1, ("strategy=mirrored", "cluster=1x2")),
    Variant("central_storage", "dlaunch central_storage [cpu:0,cpu:1]", "dlaunch", 1,
            ("strategy=central_storage", "strategy.compute_devices=[cpu:0,cpu:1]")),
    Variant("multi_worker_mirrored", "dlaunch multi_worker_mirrored 2x1", "dlaunch", 1,
            ("strategy=multi_worker_mirrored", "cluster=2x1")),
)

# (numerator, denominator, target: the ratio must be at most this, or None: information only)
STEP_RATIOS = (
    ("mirrored", "ddp", 0.8),
    ("mirrored", "ddp_nosync", 1.25),
    ("one_device", "plain", 1.03),
    ("multi_worker_mirrored", "ddp", None),
    ("central_storage", "ddp", None),
    ("mirrored", "plain", None),
    ("ddp", "plain", None),
    ("ddp_nosync", "plain", None),
)
LAUNCH_RATIOS = (("one_device", "plain"), ("mirrored", "ddp"), ("multi_worker_mirrored", "ddp"), ("central_storage", "plain"))


def command(v: Variant, steps: int, work: Path) -> list[str]:
    out = str(work / "result.json")
    if v.kind == "plain":
        return [sys.executable, str(c.HERE / "plain_loop.py"), "--steps", str(steps), "--threads", str(v.threads), "--out", out]
    if v.kind == "ddp":
        return [str(c.BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(c.HERE / "ddp_baseline.py"),
                "--steps", str(steps), "--threads", str(v.threads), "--out", out, *v.args]
    return [str(c.BIN / "dlaunch"), "recipe=bench_mlp", f"trainer.steps={steps}", *v.args, f"hydra.run.dir={work / 'run'}"]


def run_once(v: Variant, steps: int, work: Path, timeout: float, quiet_wait: float = 0) -> dict[str, Any]:
    """One command, timed from before it starts to after it ends; what it measured about itself.

    First waits up to ``quiet_wait`` seconds for other processes to leave the CPUs alone.
    """
    work.mkdir(parents=True)
    cmd = command(v, steps, work)
    env = c.clean_env(OMP_NUM_THREADS=str(v.threads))
    record: dict[str, Any] = {"variant": v.key, "command": cmd, "threads": v.threads}
    if quiet_wait > 0:
        record.update(c.wait_for_quiet(quiet_wait))
    with open(work / "stdout.txt", "w") as out, open(work / "stderr.txt", "w") as err, c.CpuWatch() as cpu:
        started_wall, started = time.time(), time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=c.ROOT, env=env, stdout=out, stderr=err, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        record["wall_s"] = time.perf_counter() - started
    record.update(rc=rc, other_cores=cpu.other_cores)
    try:
        record.update(_read_dlaunch(work) if v.kind == "dlaunch" else _read_baseline(work))
        record["first_step_s"] = record.pop("first_step_time") - started_wall
        record["ok"] = rc == 0 and record["steady_ms"] is not None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        record.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    if not record["ok"]:
        record["stderr_tail"] = (work / "stderr.txt").read_text()[-2000:]
    return record


def _read_baseline(work: Path) -> dict[str, Any]:
    data = json.loads((work / "result.json").read_text())
    steady = data["step_seconds"][WARMUP:]
    ms = [s * 1000 for s in steady]
    return {"steady_ms": c.median(ms) if len(data["step_seconds"]) > WARMUP + 1 else None, "within_run": c.spread(ms),
            "first_step_time": data["first_step_time"], "first_loss": data["first_loss"], "final_loss": data["final_loss"],
            "logged_losses": {int(k): v for k, v in data["logged_losses"].items()}}


def _read_dlaunch(work: Path) -> dict[str, Any]:
    run = work / "run"
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if records[0]["step"] != 1:  # dlaunch logs step 1
        raise ValueError(f"metrics.jsonl starts at step {records[0]['step']}, not 1")
    return {"steady_ms": summary.get("steady_ms_per_step"), "first_step_time": records[0]["time"],
            "first_loss": summary["first_loss"], "final_loss": summary["final_loss"],
            "loop_examples_per_sec": summary["examples_per_sec"], "logged_losses": {r["step"]: r["loss"] for r in records}}


def summarize(variants: list[Variant], runs: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    by = {v.key: [r for r in runs if r["variant"] == v.key and r["ok"]] for v in variants}
    reference = next((v.key for v in variants if v.key == "plain"), variants[0].key)
    ref_loss = c.median(r["final_loss"] for r in by[reference])
    table = {}
    for v in variants:
        ok = by[v.key]
        steady = [r["steady_ms"] for r in ok]
        med = c.median(steady)
        losses = [r["final_loss"] for r in ok]
        table[v.key] = {
            "label": v.label, "runs_ok": len(ok), "runs": rounds,
            "steady_ms": med, "steady_ms_spread": c.spread(steady),
            "examples_per_sec": GLOBAL_BATCH / med * 1000 if med else None,
            "first_step_s": c.median(r["first_step_s"] for r in ok),
            "wall_s": c.median(r["wall_s"] for r in ok),
            "final_loss": c.median(losses),
            "final_loss_range": [min(losses), max(losses)] if losses else None,
            "final_loss_rel_diff_vs_" + reference: (abs(c.median(losses) - ref_loss) / abs(ref_loss)) if losses and ref_loss else None,
            "synchronous": v.synchronous,
            "other_cores": c.median(r["other_cores"] for r in ok),
        }
    ratios = []
    for metric, pairs in (("steady_ms", STEP_RATIOS), ("first_step_s", [(a, b, None) for a, b in LAUNCH_RATIOS]),
                          ("wall_s", [(a, b, None) for a, b in LAUNCH_RATIOS])):
        for num, den, target in pairs:
            if num not in by or den not in by:
                continue
            per_round = []
            for k in range(rounds):
                a = next((r for r in by[num] if r["round"] == k), None)
                b = next((r for r in by[den] if r["round"] == k), None)
                if a and b and a[metric] and b[metric]:
                    per_round.append(a[metric] / b[metric])
            med = c.median(per_round)
            ratios.append({"metric": metric, "numerator": num, "denominator": den, "per_round": per_round,
                           "median": med, "spread": c.spread(per_round), "target_at_most": target,
                           "met": None if target is None or med is None else med <= target})
    return {"variants": table, "ratios": ratios, "loss_agreement": loss_agreement(variants, by)}


def loss_agreement(variants: list[Variant], by: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """How closely the synchronous variants' losses agree: early (step 40), at the end, and which are bitwise equal.

    Every synchronous variant takes the same global batches in the same order from
    the same initial parameters; they differ only in how a batch is split over
    replicas, i.e. in the order of float additions. Training amplifies those
    last-bit differences step by step (a 1e-7 change of the initial weights moves
    this workload's loss at step 200 by up to ~0.4%: docs/PERFORMANCE.md), so the
    check is tight early and loose at the end. Variants with the same split agree
    bit for bit at every step.
    """
    runs = {v.key: by[v.key][0] for v in variants if v.synchronous and by[v.key]}  # the first successful round's run
    if len(runs) < 2:
        return None
    common = sorted(set.intersection(*(set(r["logged_losses"]) for r in runs.values())))
    early = max((s for s in common if s <= 40), default=common[0])
    final = common[-1]

    def rel_spread(step: int) -> float:
        values = [r["logged_losses"][step] for r in runs.values()]
        return (max(values) - min(values)) / abs(statistics.median(values))

    groups: list[list[str]] = []
    for key, r in runs.items():
        curve = [r["logged_losses"][s] for s in common]
        for group in groups:
            if [runs[group[0]]["logged_losses"][s] for s in common] == curve:
                group.append(key)
                break
        else:
            groups.append([key])
    stable = all(len({r["final_loss"] for r in by[v.key]}) == 1 for v in variants if v.synchronous and by[v.key])
    return {"early_step": early, "early_relative_spread": rel_spread(early), "early_agree_to_1e-4": rel_spread(early) <= 1e-4,
            "final_step": final, "final_relative_spread": rel_spread(final),
            "final_losses": {k: r["final_loss"] for k, r in runs.items()},
            "bitwise_equal_curves": groups, "same_final_loss_every_round": stable}


def render(result: dict[str, Any]) -> str:
    s, m = result["summary"], result["machine"]
    v = s["variants"]
    out = [f"# bench_mlp: {result['rounds']} round(s) x {result['steps']} steps, interleaved ({result['started']})", "",
           f"Machine: {m['nproc']} CPUs ({m['cpu_model']}), torch {m['torch']}, Python {m['python']}.", ""]
    out.append(c.markdown_table(
        ["variant", "ms/step (median)", "spread min-max", "IQR", "examples/s", "start to step 1 (s)", "wall (s)",
         "final loss", "other procs (cores)", "runs ok"],
        [[row["label"], c.fmt(row["steady_ms"]), f"{c.fmt(row['steady_ms_spread']['min'])}-{c.fmt(row['steady_ms_spread']['max'])}",
          f"{c.fmt(row['steady_ms_spread']['q1'])}-{c.fmt(row['steady_ms_spread']['q3'])}", c.fmt(row["examples_per_sec"], 0),
          c.fmt(row["first_step_s"]), c.fmt(row["wall_s"]),
          (c.fmt(row["final_loss"], 6) + ("" if row["synchronous"] else " (no sync)")), c.fmt(row["other_cores"]),
          f"{row['runs_ok']}/{row['runs']}"] for row in v.values()]))
    out += ["", "ms/step: median over rounds of each run's median step time from step 20 on; spread and IQR across rounds; "
            "examples/s = 256 / median ms/step. Start to step 1: from the command's start to the end of step 1. "
            "Other procs: cores kept busy by processes outside the benchmark while it ran (about 0 on a quiet machine).", ""]
    a = s["loss_agreement"]
    if a:
        groups = "; ".join(" = ".join(g) for g in a["bitwise_equal_curves"])
        out += [f"Losses of the synchronous variants (same batches, same order; they differ only in how a batch is split "
                f"over replicas): at step {a['early_step']} they agree to a relative {a['early_relative_spread']:.2g} "
                f"(within 1e-4: {c.fmt(a['early_agree_to_1e-4'])})"
                + (f"; at step {a['final_step']} to {a['final_relative_spread']:.2g} (rounding differences grow with training)"
                   if a["final_step"] != a["early_step"] else "")
                + f". Loss curves equal bit for bit: {groups}. "
                f"Same final loss in every round: {c.fmt(a['same_final_loss_every_round'])}.", ""]
    names = {"steady_ms": "ms/step", "first_step_s": "start to step 1", "wall_s": "wall"}
    out.append(c.markdown_table(
        ["ratio (per round, then median)", "median", "min-max", "target", "met"],
        [[f"{names[r['metric']]}: {r['numerator']} / {r['denominator']}", c.fmt(r["median"], 3),
          f"{c.fmt(r['spread']['min'], 3)}-{c.fmt(r['spread']['max'], 3)}",
          "-" if r["target_at_most"] is None else f"<= {r['target_at_most']}", "-" if r["met"] is None else c.fmt(r["met"])]
         for r in s["ratios"]]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time the bench_mlp workload: dlaunch vs hand-written torch, interleaved.")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every variant (default 5; --quick: 1)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 200; --quick: 40; at least 21)")
    parser.add_argument("--quick", action="store_true", help="1 round x 40 steps, unless --rounds/--steps say otherwise")
    parser.add_argument("--variants", default=",".join(v.key for v in VARIANTS),
                        help="comma-separated subset, in this order: " + ",".join(v.key for v in VARIANTS))
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per run")
    parser.add_argument("--keep", action="store_true", help="keep each run's directory (logs, dlaunch's outputs)")
    parser.add_argument("--quiet-wait", type=float, default=30.0,
                        help="seconds to wait, before each run, for other processes to use < 0.3 cores (0: do not wait)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    steps = args.steps or (40 if args.quick else 200)
    if steps <= WARMUP + 1:
        parser.error(f"--steps must be at least {WARMUP + 2}: steady state starts at step 20")
    known = {v.key: v for v in VARIANTS}
    unknown = [k for k in args.variants.split(",") if k not in known]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(known)}")
    chosen = [v for v in VARIANTS if v.key in args.variants.split(",")]

    stamp = c.timestamp()
    result: dict[str, Any] = {"started": stamp, "rounds": rounds, "steps": steps, "global_batch_size": GLOBAL_BATCH,
                              "machine": c.machine(), "variants": [dataclasses.asdict(v) for v in chosen], "runs": []}
    scratch = Path(tempfile.mkdtemp(prefix="dlaunch-bench-"))
    print(f"bench_mlp: {rounds} round(s) x {len(chosen)} variants x {steps} steps; scratch {scratch}", flush=True)
    try:
        for k in range(rounds):
            for v in chosen:
                record = run_once(v, steps, scratch / f"r{k}-{v.key}", args.timeout, args.quiet_wait)
                record["round"] = k
                result["runs"].append(record)
                state = "ok" if record["ok"] else f"FAILED (rc {record['rc']}{', ' + record['error'] if 'error' in record else ''})"
                print(f"  round {k + 1}/{rounds}  {v.key:<22} {c.fmt(record.get('steady_ms')):>8} ms/step  "
                      f"step 1 at {c.fmt(record.get('first_step_s')):>6} s  wall {record['wall_s']:6.2f} s  "
                      f"loss {c.fmt(record.get('final_loss'), 6)}  others {c.fmt(record['other_cores'])}  {state}", flush=True)
                if not record["ok"]:
                    print(record.get("stderr_tail", ""), file=sys.stderr)
    finally:
        if args.keep:
            print(f"run directories kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    result["summary"] = summarize(chosen, result["runs"], rounds)
    text = render(result)
    c.publish(stamp, result, text)
    return 0 if all(r["ok"] for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
