"""The GPU benchmark (issue 15): scaled charlm through dlaunch and through a hand-written loop, interleaved.

    make bench-gpu                               # 3 rounds x 150 steps of every variant
    python benchmarks/gpu.py --rounds 1 --steps 60   # is everything wired?
    python benchmarks/gpu.py --rounds 6 --modes bf16+compile   # one mode, more rounds
    python benchmarks/gpu.py --profile bf16+compile   # where does each one's step time go?

The workload is charlm at 19.3M parameters (d_model 512, 8 heads, 6 layers,
context 256, global batch 64 windows = 16,384 tokens per step) on one GPU, in
four modes: fp32, bf16-mixed, bf16-mixed + ``torch.compile``, and the same compiled with CUDA graphs
(``trainer.compile.mode=reduce-overhead``, ``bf16+graphs``). Each round
runs every variant once in a fixed order, so drifts of the machine hit all
alike; ratios are taken within a round, then their median.

Per run it records the median wall time per step from step 20 on (dlaunch's
``steady_ms_per_step``; gpu_loop.py measures the same way), and derives
tokens/s and MFU: 6 x parameters + 12 x layers x context x d_model FLOPs per
token (forward and backward, attention included) over the GPU's dense bf16 peak.
One more dlaunch variant runs bf16 (eager: the most allocations per step) with ``input.copy_stream=side``: each batch copied on a side
stream, overlapping the step in flight, against the default copy on the step's own stream (as the hand loop
copies). A side stream hides the copy; its ``record_stream`` makes every allocation query an event until the
step ends, which a host-bound step pays for.

Writes ``benchmarks/results/TIMESTAMP-gpu.json`` and ``.md``.

``--profile MODE`` runs no rounds: it profiles steps 33-37 of one dlaunch run (``trainer.profile``) and of
one hand-loop run in that mode, and writes both op tables (with the host time per step of the data and
step regions) to ``benchmarks/results/TIMESTAMP-gpu-profile.md``: the next thing to read when a ratio
falls short.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as c  # noqa: E402

SHAPE = {"d_model": 512, "heads": 8, "layers": 6, "context": 256}
BATCH = 64
# Dense bf16 tensor-core peaks (FLOP/s), by a substring of torch.cuda.get_device_name().
PEAKS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
MODES = {
    "fp32": ((), ("--precision", "fp32")),
    "bf16": (("trainer.precision=bf16-mixed",), ("--precision", "bf16")),
    "bf16+compile": (("trainer.precision=bf16-mixed", "trainer.compile.enabled=true"), ("--precision", "bf16", "--compile")),
    # CUDA graphs (torch.compile's mode reduce-overhead): the launches of a host-bound step, replayed at once
    "bf16+graphs": (("trainer.precision=bf16-mixed", "trainer.compile.enabled=true", "trainer.compile.mode=reduce-overhead"),
                    ("--precision", "bf16", "--compile", "--compile-mode", "reduce-overhead")),
}
SIDE = "bf16, side stream"  # bf16 (eager) with input.copy_stream=side
INSIDE = "hand, run by dlaunch"  # the hand loop as `dlaunch script=gpu_loop.py`: in dlaunch's process


def dlaunch_command(extra: tuple[str, ...], steps: int, run_dir: Path, shape: dict[str, int] = SHAPE, batch: int = BATCH,
                    device: str = "cuda") -> list[str]:
    """The dlaunch command of one run: charlm in ``shape`` on one device, with ``extra`` overrides."""
    return [sys.executable, "-m", "launcher.cli.entry", "recipe=charlm", "strategy=one_device", f"cluster.device={device}",
            *(f"recipe.{k}={v}" for k, v in shape.items()), f"input.global_batch_size={batch}", f"trainer.steps={steps}",
            "trainer.log_every=50", "recipe.sample_chars=0", "recipe.eval_windows=64", *extra, f"hydra.run.dir={run_dir}"]


def hand_command(extra: tuple[str, ...], steps: int, out: Path, shape: dict[str, int] = SHAPE, batch: int = BATCH,
                 device: str = "cuda") -> list[str]:
    """The hand loop's command (gpu_loop.py) of the same run."""
    return [sys.executable, str(c.HERE / "gpu_loop.py"), *extra, *(f"--{k.replace('_', '-')}={v}" for k, v in shape.items()),
            f"--batch={batch}", f"--steps={steps}", f"--out={out}", f"--device={device}"]


def dlaunch(extra: tuple[str, ...], steps: int, work: Path, keep_dir: bool = False) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(dir=work))
    proc = subprocess.run(dlaunch_command(extra, steps, run_dir), capture_output=True, text=True, env=c.clean_env(), cwd=work)
    if proc.returncode:
        raise SystemExit(f"dlaunch {' '.join(extra)} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    found = {"steady_ms_per_step": summary["steady_ms_per_step"], "final_loss": summary["final_loss"]}
    return {**found, "run_dir": str(run_dir)} if keep_dir else found


def hand(extra: tuple[str, ...], steps: int, work: Path) -> dict[str, Any]:
    out = Path(tempfile.mkstemp(dir=work, suffix=".json")[1])
    proc = subprocess.run(hand_command(extra, steps, out), capture_output=True, text=True, env=c.clean_env(), cwd=c.ROOT)
    if proc.returncode:
        raise SystemExit(f"gpu_loop.py {' '.join(extra)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def hand_inside(extra: tuple[str, ...], steps: int, work: Path, shape: dict[str, int] = SHAPE, batch: int = BATCH,
                device: str = "cuda") -> dict[str, Any]:
    """The hand loop run by dlaunch (``dlaunch script=gpu_loop.py``, in dlaunch's own process, as a one_device script
    runs): the same loop in dlaunch's process and environment. Equal to ``hand``: dlaunch's loop makes the gap;
    equal to ``dlaunch``: something of dlaunch's process (its imports, threads, settings) does."""
    out = Path(tempfile.mkstemp(dir=work, suffix=".json")[1])
    loop = hand_command(extra, steps, out, shape, batch, device)[2:]  # its arguments: no interpreter, no script
    command = [sys.executable, "-m", "launcher.cli.entry", f"script={c.HERE / 'gpu_loop.py'}", "strategy=one_device",
               f"cluster.device={device}", f"hydra.run.dir={tempfile.mkdtemp(dir=work)}", "--", *loop]
    proc = subprocess.run(command, capture_output=True, text=True, env=c.clean_env(), cwd=work)
    if proc.returncode:
        raise SystemExit(f"dlaunch script=gpu_loop.py {' '.join(extra)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def device_facts() -> dict[str, Any]:
    import torch

    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAKS.items() if k in name), None)
    return {"gpu": name, "torch": torch.__version__, "cuda": torch.version.cuda, "bf16_peak_flops": peak}


def flops_per_token(params: int) -> float:
    return 6 * params + 12 * SHAPE["layers"] * SHAPE["context"] * SHAPE["d_model"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    # the two ratios first (fp32, bf16+compile), so a run cut off by a device call's limit has them
    parser.add_argument("--modes", default="fp32,bf16+compile,bf16+graphs,bf16",
                        help="comma-separated subset of %(default)s, run in that order "
                             "(fewer modes: more rounds in the same time)")
    parser.add_argument("--profile", metavar="MODE", choices=list(MODES), help="profile one run of each in MODE instead")
    parser.add_argument("--inside", action="store_true",
                        help="also run the hand loop by dlaunch (script=gpu_loop.py): dlaunch's loop, or its process?")
    args = parser.parse_args()
    if args.profile:
        return profile(args.profile, max(args.steps, 40))
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    facts, runs, stem = device_facts(), [], f"{c.timestamp()}-gpu"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            for mode in modes:
                dl_args, loop_args = MODES[mode]
                runs.append({"round": r, "mode": mode, "who": "dlaunch", **dlaunch(dl_args, args.steps, work)})
                runs.append({"round": r, "mode": mode, "who": "hand", **hand(loop_args, args.steps, work)})
                print(f"round {r + 1}/{args.rounds} {mode}: dlaunch {runs[-2]['steady_ms_per_step']:.2f} ms/step, "
                      f"hand {runs[-1]['steady_ms_per_step']:.2f}", flush=True)
                if args.inside:
                    runs.append({"round": r, "mode": mode, "who": INSIDE, **hand_inside(loop_args, args.steps, work)})
                    print(f"  hand loop run by dlaunch: {runs[-1]['steady_ms_per_step']:.2f}", flush=True)
                data = so_far(stem, facts, runs, r, args)  # a run cut off (a device call's time limit) keeps these
            if "bf16" in modes:
                runs.append({"round": r, "mode": SIDE, "who": "dlaunch",
                             **dlaunch((*MODES["bf16"][0], "input.copy_stream=side"), args.steps, work)})
                data = so_far(stem, facts, runs, r, args)
    c.publish(stem, data, report(facts, runs, args))


def so_far(stem: str, facts: dict[str, Any], runs: list[dict[str, Any]], r: int, args: argparse.Namespace) -> dict:
    """The results so far, written after every pair of runs: a run cut off by a device call's time limit keeps them."""
    facts["params"] = next(run["params"] for run in runs if "params" in run)
    data = {"machine": c.machine(), "device": facts, "shape": SHAPE, "batch": BATCH, "runs": runs}
    c.write_results(stem, data, report(facts, runs, argparse.Namespace(rounds=f"{r + 1} (so far)", steps=args.steps)))
    return data


def profile(mode: str, steps: int) -> None:
    """One dlaunch run and one hand-loop run in ``mode``, each profiled over steps 33-37; both op tables, side by side."""
    dl_args, loop_args = MODES[mode]
    window = ("trainer.profile.enabled=true", "trainer.profile.wait=30", "trainer.profile.warmup=2", "trainer.profile.active=5")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        mine = dlaunch((*dl_args, *window), steps, work, keep_dir=True)
        theirs = hand((*loop_args, f"--profile={work}"), steps, work)
        tables = {"dlaunch": Path(mine["run_dir"]) / "profile" / "rank0-ops.txt", "hand": work / "profile" / "hand-ops.txt"}
        text = "\n".join([
            f"# GPU profile: scaled charlm, {mode}, on {device_facts()['gpu']}", "",
            f"dlaunch {mine['steady_ms_per_step']:.2f} ms/step, hand loop {theirs['steady_ms_per_step']:.2f} ms/step "
            f"({steps} steps each). Each table: steps 33-37; the regions' host time per step first.", "",
            *(part for who, path in tables.items() for part in (f"## {who}", "", "```", path.read_text(), "```", "")),
        ])
    mine.pop("run_dir")  # gone with the temporary directory
    c.publish(f"{c.timestamp()}-gpu-profile", {"mode": mode, "dlaunch": mine, "hand": theirs}, text)


def report(facts: dict[str, Any], runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    tokens = BATCH * SHAPE["context"]
    per_token = flops_per_token(facts["params"])

    def ms(mode: str, who: str) -> list[float]:
        return [run["steady_ms_per_step"] for run in runs if run["mode"] == mode and run["who"] == who]

    def ratio(a: list[float], b: list[float]) -> float | None:  # per round, then the median: b's time over a's
        return c.median(y / x for x, y in zip(a, b))

    rows = []
    for mode in [*MODES, SIDE]:
        for who in ("dlaunch", "hand", INSIDE):
            times = ms(mode, who)
            if not times:
                continue
            median = c.median(times)
            tps = tokens / (median / 1000)
            mfu = per_token * tps / facts["bf16_peak_flops"] if facts["bf16_peak_flops"] else None
            vs_hand = ratio(times, ms(mode, "hand")) if who != "hand" and mode in MODES else None
            rows.append([mode, who, c.fmt(median), f"{min(times):.2f}-{max(times):.2f}", f"{tps:,.0f}",
                         "-" if mfu is None else f"{mfu:.1%}", "-" if vs_hand is None else f"{vs_hand:.3f}x"])
    speedup = ratio(ms("bf16+compile", "dlaunch"), ms("fp32", "dlaunch"))
    graphs = ratio(ms("bf16+graphs", "dlaunch"), ms("fp32", "dlaunch"))
    side = ratio(ms("bf16", "dlaunch"), ms(SIDE, "dlaunch"))
    lines = [
        f"# GPU benchmark: scaled charlm on {facts['gpu']}",
        "",
        f"torch {facts['torch']} (CUDA {facts['cuda']}); {facts['params']:,} parameters; {tokens:,} tokens per step; "
        f"{args.rounds} round(s) x {args.steps} steps; median steady ms/step (step 20 on).",
        "",
        c.markdown_table(["mode", "who", "ms/step", "range", "tokens/s", "MFU", "dlaunch / hand tokens/s"], rows),
        "",
        f"- dlaunch bf16 + compile vs dlaunch fp32: **{c.fmt(speedup)}x** faster (target >= 4x on an H100); "
        f"with CUDA graphs (mode reduce-overhead): **{c.fmt(graphs)}x**.",
        f"- input copies (pinned memory, non_blocking, fetched after the step before is launched): on a side stream "
        f"(`input.copy_stream=side`) a bf16 step takes {c.fmt(side, 3)}x the time of the default copy on the step's own "
        "stream (< 1: overlapping the copy pays; > 1: the side stream's record_stream costs more host time than the "
        "copy it hides).",
        "- targets: every dlaunch mode >= 0.97x the hand loop's tokens/s in the same mode (the last column).",
        f"- `{INSIDE}` (with --inside): the hand loop as `dlaunch script=gpu_loop.py`, in dlaunch's own process. Near "
        "1.00x: the gap is dlaunch's loop; near dlaunch's own ratio: something of dlaunch's process is.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
