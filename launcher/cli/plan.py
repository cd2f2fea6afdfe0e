"""The plan: what a run will start, shown before it starts (and alone with ``launch.dry_run=true``)."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from launcher.config.errors import ConfigError, Problem
from launcher.config.plan import Plan
from launcher.config.run_rules import no_batch
from launcher.config.schema import RunSpec
from launcher.config.trainer import TrainerSpec
from launcher.input.auto_shard import AutoShardPolicy, ShardPlan, resolve_policy, shard_rows
from launcher.input.files import count_rows


def plan_rows(spec: RunSpec, plan: Plan, run_dir: Path, resume_from: Path | None = None) -> list[tuple[str, str]]:
    """The plan's rows: the strategy chooses them (``StrategyUnit.plan_rows``), from the standard ones."""
    rows = spec.strategy.plan_rows(Rows(spec, plan, run_dir, resume_from))
    return rows if spec.script is None else _script_rows(spec, rows)


class Rows:
    """The plan's standard rows for one run, and the parts of them a strategy's own rows reuse."""

    def __init__(self, spec: RunSpec, plan: Plan, run_dir: Path, resume_from: Path | None):
        self.spec, self.plan, self.run_dir, self.resume_from = spec, plan, run_dir, resume_from

    def standard(self) -> list[tuple[str, str]]:
        """One process per device (or one process), started here or by torch.distributed.elastic."""
        spec, plan, c = self.spec, self.plan, self.spec.cluster
        n, processes, device = plan.replicas, plan.processes, plan.device_type
        if device == "cuda":
            devices = ", ".join(f"cuda:{i}" for i in range(c.devices_per_node if n > 1 else 1))
            if c.emulated and plan.cuda_devices >= c.world_size:  # each node here sees its own slice as cuda:0..M-1
                devices = f"{devices} on each node: node i has this machine's GPUs {c.devices_per_node}i..{c.devices_per_node}i+{c.devices_per_node - 1}"
        else:
            devices = f"cpu x {processes}" if processes > 1 else "cpu"
        return [
            self.row("strategy"), self.row("recipe"),
            ("cluster", f"{c.shape}: {c.nodes} node(s) x {c.devices_per_node} device(s) per node ({device})"),
            ("processes", _processes(spec, processes, device)),
            *_nodes_row(spec, processes),
            ("replicas", spec.strategy.replicas_row(n)),
            ("devices", devices),
            ("backend", plan.backend if processes > 1 else "none (one process)"),
            *_rendezvous_row(spec, processes),
            *_network_rows(spec),
            ("batch", self.batch("replica(s)")),
            self.row("input"),
            ("steps", f"{spec.trainer.steps} (seed {spec.trainer.seed}, log every {spec.trainer.log_every})"),
            self.row("training"),
            *spec.strategy.own_rows(spec, self.run_dir),
            ("checkpoints", self.checkpoints()),
            *self.resume(),
            self.row("run dir"),
        ]

    def row(self, key: str) -> tuple[str, str]:
        """A row every plan shows the same way: strategy, recipe, input, training or run dir."""
        spec = self.spec
        value = {
            "strategy": spec.strategy.describe,
            "recipe": lambda: f"{spec.recipe.name} ({spec.recipe.entry})",
            "input": lambda: _input_summary(spec),
            "training": lambda: _training(spec, self.plan.device_type),
            "run dir": lambda: str(self.run_dir),
        }[key]()
        return key, value

    def batch(self, what: str) -> str:
        return _batch(self.spec, self.plan.replicas, what)

    def checkpoints(self) -> str:
        return _checkpoints(self.spec, self.run_dir)

    def resume(self) -> list[tuple[str, str]]:
        return [*_resume_rows(self.spec, self.run_dir, self.resume_from), *self.spec.trainer.pretrained.rows(self.resume_from)]


# What a script keeps of the plan: its processes and devices; the batch, steps and checkpoints are its own business.
_SCRIPT_ROWS = ("strategy", "cluster", "processes", "nodes", "replicas", "devices", "backend", "rendezvous", "run dir")


def _script_rows(spec: RunSpec, rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    where = "in each of the processes" if spec.num_processes > 1 else "in this process"
    kept = [row for row in rows if row[0] in _SCRIPT_ROWS]
    script = ("script", f"{spec.script.command()} (as __main__ {where}; dl.get_strategy() returns this strategy)")
    precision, recomputed = spec.trainer.precision, spec.trainer.activation_checkpointing
    scaler = " and strategy.grad_scaler()" if precision == "fp16-mixed" else ""
    extra = [("precision", f"{precision} where the script enters strategy.autocast(){scaler}")] if precision != "fp32" else []
    if recomputed:
        extra.append(("recompute", f"{', '.join(recomputed)} in backward, in the model the script gives strategy.prepare()"))
    return [kept[0], script, *extra, *kept[1:]]


def _batch(spec: RunSpec, n: int, what: str) -> str:
    k = spec.trainer.grad_accum_steps
    kept = "" if spec.input.drop_remainder or spec.script is not None else (
        "; an epoch's last partial batch is kept (input.drop_remainder=false)" + (", each replica's share weighted by its rows" if n > 1 else "")
        + ("; under FILE sharding each epoch ends with the shortest worker, so a worker with more batches drops its rows "
           "past that step, its partial last batch included" if _file_sharded(spec) else ""))
    if k == 1:
        return f"global {spec.input.global_batch_size} = {n} {what} x {spec.per_replica_batch_size} per replica{kept}"
    return (f"global {spec.input.global_batch_size} = micro-batch {spec.micro_batch_size} x {n} {what} x {k} accumulation steps "
            f"(one gradient sync and update per step){kept}")


def _file_sharded(spec: RunSpec) -> bool:
    """Each of several workers reads its own files (FILE): their shards may hold different numbers of batches."""
    inp = spec.input
    return bool(inp.files) and spec.num_processes > 1 and \
        resolve_policy(inp.policy, len(inp.files), spec.num_processes) is AutoShardPolicy.FILE


def _training(spec: RunSpec, device: str) -> str:
    """Precision, compile, clipping, schedule and evaluation: how each step trains."""
    t = spec.trainer
    precision = {"fp32": "fp32", "bf16-mixed": f"bf16 autocast on {device}, fp32 weights",
                 "fp16-mixed": f"fp16 autocast on {device} + GradScaler (skipped steps counted)"}[t.precision]
    parts = [precision, *filter(None, [spec.strategy.precision_note(t.precision)])]
    if t.compile.enabled:
        parts.append(f"torch.compile (mode {t.compile.mode}{', fullgraph' if t.compile.fullgraph else ''})")
    if t.activation_checkpointing:
        parts.append(f"recompute {', '.join(t.activation_checkpointing)} in backward (activation checkpointing)")
    if t.clip_grad_norm is not None:
        parts.append(f"clip grad norm {t.clip_grad_norm:g}")
    if not t.lr_schedule.constant:
        parts.append(f"lr: {_schedule(t)}")
    if t.eval_every:  # longer than the run (a short trial of a long recipe): said, not refused
        late = f" (none before the end: trainer.steps={t.steps})" if t.eval_every >= t.steps else ""
        parts.append(f"evaluate every {t.eval_every} steps{late}")
    if t.profile.enabled:
        first = t.profile.wait + t.profile.warmup + 1
        parts.append(f"profile steps {first}-{first + t.profile.active - 1} of this command to RUN_DIR/profile")
    return "; ".join(parts)


def _schedule(t: TrainerSpec) -> str:
    """The warm-up (from where), the decay (over how many steps, to what) and the steps held at its end."""
    s = t.lr_schedule
    start = f" from {s.warmup_start:g} x lr" if s.warmup_start else ""
    warm = f"{s.warmup_steps} warm-up step(s){start}" if s.warmup_steps else ""
    if s.decay == "constant":
        return f"{warm}, then constant"
    over = f" over {s.decay_steps} steps" if s.decay_steps else ""
    held = t.steps - s.warmup_steps - s.decay_length(t.steps)
    decay = f"{s.decay} decay{over} to {s.min_lr_ratio:g} x lr" + (f", held for the last {held}" if held > 0 else "")
    return f"{warm}, then {decay}" if warm else decay


def _checkpoints(spec: RunSpec, run_dir: Path) -> str:
    c = spec.trainer.checkpoint
    if not c.every_steps:
        restarts = "; a restart begins again at step 0" if spec.launch.max_restarts else ""
        return f"off (trainer.checkpoint.every_steps=N turns them on){restarts}"
    from launcher import checkpoint  # torch.distributed.checkpoint: imported only when checkpoints are on

    best = f", and the one with {c.best.said()}" if c.best.metric else ""
    return (f"every {c.every_steps} steps, at the end and on SIGTERM/SIGINT/SIGHUP (DCP; keep {c.keep}{best}) "
            f"in {checkpoint.root_of(spec, run_dir)}")


def _resume_rows(spec: RunSpec, run_dir: Path, resume_from: Path | None) -> list[tuple[str, str]]:
    if resume_from is None:
        if spec.trainer.resume != "auto" or not spec.trainer.checkpoint.every_steps:
            return []
        from launcher import checkpoint

        return [("resume", f"none: no checkpoint in {checkpoint.root_of(spec, run_dir)} yet; training starts at step 0")]
    from launcher.checkpoint import layout, manifest

    saved = layout.read_manifest(resume_from)
    pos = saved["data_position"]
    rows = [("resume", f"from step {saved['step']} ({resume_from}; {saved['strategy']} {saved['cluster']}, "
                       f"epoch {pos['epoch']}, batch {pos['offset']}; {_verified(saved)})")]
    from launcher import checkpoint

    # only this run's own checkpoints are set aside, and only by a run that saves its own
    own = resume_from.parent.resolve() == checkpoint.root_of(spec, run_dir).resolve()
    newer = ", ".join(p.name for p in layout.newer_steps(resume_from)) if own else ""
    fate = "set aside when the run starts" if spec.trainer.checkpoint.every_steps else "left as they are (checkpoints are off)"
    if newer and spec.trainer.resume == "auto":
        rows.append(("  skipped", f"{newer}: damaged (see the warning above); {fate}"))
    elif newer:
        rows.append(("  later", f"{newer}: another timeline from here on; {fate}"))
    rows += [("  changed", change) for change in manifest.changes(saved, spec)]
    if saved["step"] >= spec.trainer.steps:
        rows.append(("  note", f"the checkpoint already reaches trainer.steps={spec.trainer.steps}: nothing left to train"))
    return rows


def _verified(saved: dict) -> str:
    files = saved.get("files")
    if files is None:
        return "saved without checksums: not verified"
    return f"{len(files)} file(s), {sum(f['size'] for f in files.values()) / 2**20:.1f} MiB, sizes and sha256 verified"


def _processes(spec: RunSpec, processes: int, device: str) -> str:
    c = spec.cluster
    if processes == 1:
        return "1 (this process)"
    if c.nodes > 1 and not c.emulated:
        return f"{c.devices_per_node} on this node ({processes} in all), one per device, started by torch.distributed.elastic" + \
            _crowded(device, c.devices_per_node)
    return f"{processes}, one per device, started by torch.distributed.elastic" + _crowded(device, processes)


def _crowded(device: str, here: int) -> str:
    """CPU processes on this machine beyond its cores (cluster=1x64 on 2 cores): what each gets."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if device != "cpu" or here <= cores:
        return ""
    return f"; [yellow]{here} processes on this machine's {cores} CPU core(s): each gets about 1/{here / cores:.3g} of a core[/]"


def _nodes_row(spec: RunSpec, processes: int) -> list[tuple[str, str]]:
    c = spec.cluster
    if c.nodes == 1 or processes == 1:
        return []
    if c.emulated:
        return [("nodes", f"{c.nodes} emulated on this machine: one elastic agent process per node, "
                          f"real node/local/group ranks (run each node elsewhere with cluster.node_rank=i)")]
    hosts = c.node_hosts()
    here = f" ({hosts[c.node_rank]})" if hosts else ""
    results = "results are written here" if c.node_rank == 0 else "rank 0 and the results are on node 0"
    return [("nodes", f"this machine is node {c.node_rank} of {c.nodes}{here}: {c.ranks_of(c.node_rank)}; {results}")]


def _rendezvous_row(spec: RunSpec, processes: int) -> list[tuple[str, str]]:
    if processes == 1:
        return []
    c = spec.cluster
    where = "loopback only" if c.loopback else f"listening on {c.master_addr}"
    host = "hosted by node 0" if c.nodes > 1 else "on this machine"
    return [("rendezvous", f"{c.master_addr}:{c.master_port or '<free port>'} (c10d {host}, {where}; "
                           f"nodes wait {spec.launch.rdzv_timeout_s} s, ranks {spec.launch.preflight_timeout_s} s)")]


def _network_rows(spec: RunSpec) -> list[tuple[str, str]]:
    """A node of a multi-node job: the interface its collectives use, and the admission token."""
    c = spec.cluster
    if c.nodes == 1 or c.emulated or c.loopback:
        return []
    from launcher.cluster import admission, interface
    from launcher.cluster.env import user_interface_variables

    return [("network", interface.describe(c.master_addr, user_interface_variables())),
            ("admission", admission.describe(spec))]


def _input_summary(spec: RunSpec) -> str:
    inp = spec.input
    if not inp.files:  # a dataset or an iterable: known only once the workers run build()
        order = f"shuffled (seed {spec.input_seed}) into" if inp.shuffle else "read in order as"
        return (f"the recipe's data (its kind is known once built): a map-style dataset is {order} global batches "
                f"of {inp.global_batch_size}, an iterable gives its own; each global batch split across the replicas")
    order = f"shuffled (seed {spec.input_seed})" if inp.shuffle else "in file order"
    resolved = resolve_policy(inp.policy, len(inp.files), spec.num_processes).value
    policy = resolved if inp.auto_shard_policy == resolved else f"{inp.auto_shard_policy} -> {resolved}"
    return (
        f"{len(inp.files)} {inp.file_format} file(s) in {_common_dir(inp.files)}, {order}; "
        f"auto_shard_policy {policy}; prefetch {inp.prefetch}"
    )


def _common_dir(files: list[str]) -> str:
    return os.path.commonpath([os.path.dirname(f) for f in files])


def shard_table(spec: RunSpec, count: bool = True) -> Group | None:
    """Which worker reads which files (or which share of the elements); None without input.files.

    Counting elements reads every file, so a real run (whose workers read them anyway) skips it.
    """
    inp = spec.input
    if not inp.files:
        return None
    workers = spec.num_processes
    policy = resolve_policy(inp.policy, len(inp.files), workers)
    base = _common_dir(inp.files)
    names = [os.path.relpath(f, base) for f in inp.files]
    counts = [_count(f, inp.file_format) for f in inp.files] if count else None
    nodes, per_node = (spec.cluster.nodes, spec.cluster.devices_per_node) if workers > 1 else (1, 1)
    if counts is None:  # a real run: no column left empty, and the way to the counts said once
        title = f"input shards ({policy.value}; launch.dry_run=true counts each worker's elements)"
    else:
        title = f"input shards ({policy.value}, {sum(counts)} elements)"
    table = Table(box=None, padding=(0, 2))
    columns = ("rank", "node", "reads", "elements") if counts is not None else ("rank", "node", "reads")
    for column in columns:
        table.add_column(column, justify="right" if column == "elements" else "left")
    for row in shard_rows(policy, names, counts, nodes, per_node):
        table.add_row(*row[:len(columns)])
    if counts is not None:
        _check_a_batch(spec, sum(counts))
        _check_each_worker_a_batch(spec, policy, counts)
    note = _uneven_note(spec, policy, counts) if counts else None
    return Group(Text(title), table, *([Text(note)] if note else []))  # lines as wide as the terminal, not the table


def _count(path: str, fmt: str) -> int:
    """A file's element count; a file that cannot be read whole is a config error naming it."""
    try:
        return count_rows(path, fmt)
    except Exception as exc:  # noqa: BLE001 - whatever the reader raises, the file is at fault
        first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:160]
        reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        raise ConfigError([Problem(key="input.files", value=path, message=f"{path} cannot be read as {fmt} ({reason})")]) from None


def _check_a_batch(spec: RunSpec, rows: int) -> None:
    """Files whose rows fill no global batch (a dry run counts them): a config error, not the workers' NoBatch."""
    inp = spec.input
    if rows == 0 or (inp.drop_remainder and rows < inp.global_batch_size):
        multiple = spec.num_replicas * spec.trainer.grad_accum_steps
        why = no_batch(rows, inp.global_batch_size, multiple, f"the {len(inp.files)} input file(s)")
        raise ConfigError([Problem(key="input.global_batch_size", value=inp.global_batch_size, message=why)])


def _check_each_worker_a_batch(spec: RunSpec, policy: AutoShardPolicy, counts: list[int]) -> None:
    """FILE: every epoch ends with the shortest worker's shard; one that fills no batch of its share leaves none."""
    steps, sizes, local = _file_steps(spec, policy, counts)
    if steps == 0 and policy is AutoShardPolicy.FILE and spec.num_processes > 1 and spec.num_processes == spec.num_replicas:
        short = sizes.index(min(sizes))
        raise ConfigError([Problem(key="input.auto_shard_policy", value=policy.value, message=(
            f"FILE gives each of the {spec.num_processes} workers its own files, and every epoch ends with the shortest "
            f"worker's: rank {short} reads {sizes[short]} element(s), fewer than its {local} of each global batch "
            f"(input.global_batch_size={spec.input.global_batch_size}), so no step would have a batch; use more, "
            "equal-sized files, a smaller input.global_batch_size, or input.auto_shard_policy=DATA"))])


def _file_steps(spec: RunSpec, policy: AutoShardPolicy, counts: list[int]) -> tuple[int, list[int], int]:
    """The steps of an epoch, each worker's elements and its rows of a global batch."""
    workers = spec.num_processes
    local, drop = spec.input.global_batch_size // workers, spec.input.drop_remainder
    sizes = [ShardPlan(policy, workers, w).element_count(counts) for w in range(workers)]
    return min(size // local if drop else -(-size // local) for size in sizes), sizes, local


def _uneven_note(spec: RunSpec, policy: AutoShardPolicy, counts: list[int]) -> str | None:
    """FILE shards of different sizes: every epoch ends at the shortest worker's last batch."""
    workers = spec.num_processes
    if policy is not AutoShardPolicy.FILE or workers == 1:
        return None
    steps, sizes, local = _file_steps(spec, policy, counts)
    if all((size // local if spec.input.drop_remainder else -(-size // local)) == steps for size in sizes):
        return None
    left_out = sum(size - min(size, steps * local) for size in sizes)
    kept = "" if spec.input.drop_remainder else ("; input.drop_remainder=false keeps the shortest worker's partial last batch, not a longer "
                            "worker's: its rows past that step are dropped, its partial last batch with them")
    return (
        f"uneven shards: each epoch ends with the shortest worker, after {steps} step{'' if steps == 1 else 's'}; "
        f"{left_out} of {sum(sizes)} elements are left out of each epoch{kept} (equal-sized files, a multiple of "
        f"{workers} of them, avoid this)"
    )


def show_plan(spec: RunSpec, plan: Plan, run_dir: Path, console: Console, dry_run: bool,
              resume_from: Path | None = None) -> list[tuple[str, str]]:
    """Print the plan; its rows, for a sweep to compare the next jobs with."""
    shards = shard_table(spec, count=dry_run)  # first: a file that cannot be counted is an error, not half a plan
    title = "dlaunch plan" + (" (dry run: nothing is started)" if dry_run else "")
    rows = plan_rows(spec, plan, run_dir, resume_from)
    console.print(rows_table(title, rows))
    if shards is not None:
        console.print(shards)
    for table in spec.strategy.plan_tables(spec, run_dir):
        console.print(table)
    return rows


def rows_table(title: str, rows: list[tuple[str, str]]) -> Table:
    """Two columns, a bold key and its value: the plan's look."""
    table = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


def show_summary(summary: dict, run_dir: Path, console: Console) -> None:
    keys = ("status", "final_loss", "first_loss", "examples_per_sec", "first_step_seconds", "wall_seconds", "param_norm")
    rows = [(key, f"{v:.6g}" if isinstance(v, float) else str(v)) for key in keys if (v := summary.get(key)) is not None]
    rows += [(key, f"{value:.6g}") for key, value in (summary.get("metrics") or {}).items()]
    if best := summary.get("best"):
        from launcher.cli.report.jobs import best_said

        rows.append(("best", best_said(best)))
    console.print(rows_table("result", rows))
    files = [name for name in ("config.yaml", "metrics.jsonl", "summary.json") if (run_dir / name).exists()]
    console.print(f"results: [bold]{run_dir}[/] ({', '.join(files)})")
