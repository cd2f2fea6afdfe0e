"""The submit side of ``hydra/launcher=submitit_slurm``: what SLURM has, what dlaunch asks for, and its refusals.

``cluster.device=auto`` is decided against the partition, not against the
submit host (a login node without a GPU says nothing about the compute nodes):
dlaunch asks ``sinfo`` for the partition's generic resources and requests
``gpus_per_node`` only when its nodes have GPUs. The request is shown before
submitting; an ``sbatch`` refusal is one screen (what was asked, what SLURM
said, which override to change) and exit code 2, with nothing submitted.

    dlaunch hydra/launcher=submitit_slurm hydra.launcher.partition=debug strategy=mirrored cluster=1x2
"""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _SubmititSlurmLauncher

from launcher.config.errors import ConfigError, Problem

SINFO_TIMEOUT_S = 20
REFUSED_EXIT = 2  # nothing was submitted: like a config error, the command as given cannot run
NOT_A_SUBMIT_HOST = "this machine is not a SLURM submit host"


@dataclasses.dataclass(frozen=True)
class Partition:
    """One SLURM partition as sinfo reports it: its node groups' CPUs and GPUs."""

    name: str
    cpus: tuple[int, ...]  # per node, one entry per group of like nodes
    gpus: tuple[int, ...]  # per node, likewise; 0: no gpu gres
    nodes: tuple[int, ...] = ()  # how many nodes each group has

    def describe(self) -> str:
        gpus = "no GPU gres" if not any(self.gpus) else "/".join(f"gpu:{g}" for g in self.gpus) + " per node"
        return f"partition {self.name} has {gpus} (sinfo; {'/'.join(map(str, self.cpus))} CPUs per node)"


@dataclasses.dataclass(frozen=True)
class Sinfo:
    """What sinfo said: the partitions and the default one; ``error`` when it could not be asked."""

    partitions: dict[str, Partition] = dataclasses.field(default_factory=dict)
    default: str | None = None
    error: str | None = None

    def get(self, name: str | None) -> Partition | None:
        return self.partitions.get(name or self.default or "")


def _gpus(gres: str) -> int:
    """GPUs per node in sinfo's %G, e.g. ``gpu:4``, ``gpu:a100:8(S:0-1)``, ``(null)``."""
    return sum(int(m) for m in re.findall(r"gpu(?::[\w.-]+)*?:(\d+)", gres))


def _count(text: str) -> int:
    return int(re.sub(r"\D", "", text) or 0)  # "2+" (a range's least) -> 2


def parse_sinfo(text: str) -> Sinfo:
    """sinfo ``--noheader --format=%P|%c|%G|%D`` lines: partition (``*`` marks the default), CPUs, gres, nodes."""
    groups: dict[str, list[tuple[int, int, int]]] = {}
    default = None
    for line in text.splitlines():
        if line.count("|") != 3:
            continue
        name, cpus, gres, nodes = line.split("|")
        if name.endswith("*"):
            name = default = name[:-1]
        groups.setdefault(name, []).append((_count(cpus), _gpus(gres), _count(nodes)))
    parts = {n: Partition(n, *(tuple(column) for column in zip(*g))) for n, g in groups.items()}
    return Sinfo(parts, default)


def sinfo() -> Sinfo:
    """Ask this machine's SLURM (the submit host's sinfo) for its partitions."""
    command = ["sinfo", "--noheader", "--format=%P|%c|%G|%D"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Sinfo(error=f"{' '.join(command)}: {exc}")
    if proc.returncode:
        return Sinfo(error=f"sinfo exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return parse_sinfo(proc.stdout)


def device(spec: Any, info: Sinfo, partition: str | None) -> tuple[str, str]:
    """``cpu`` or ``cuda`` for the job's nodes, and why: ``cluster.device``, or for ``auto`` the partition's gres."""
    c = spec.cluster
    if c.device != "auto":
        return c.device, f"cluster.device={c.device}"
    where = f"partition {partition}" if partition else "the default partition"
    fix = f"set cluster.device=cuda (asks gpus_per_node={c.devices_per_node}) or cluster.device=cpu"
    if info.error:
        raise _auto_problem(f"cluster.device=auto asks SLURM whether {where} has GPUs, and {info.error}; {fix}")
    found = info.get(partition)
    if found is None:
        known = ", ".join(sorted(info.partitions)) or "none"
        raise ConfigError([Problem(key="hydra.launcher.partition", value=partition or "(default)",
                                   message=f"SLURM has no such partition (sinfo lists: {known})", allowed=tuple(sorted(info.partitions)))])
    if all(found.gpus):
        return "cuda", f"cluster.device=auto and {found.describe()}"
    if any(found.gpus):
        raise _auto_problem(f"cluster.device=auto cannot choose: only some nodes of {found.describe()}; {fix}")
    return "cpu", f"cluster.device=auto and {found.describe()}"


def cpus_per_task(spec: Any, device: str, partition: Partition | None) -> dict[str, int]:
    """Asked unless given (SLURM's default is one CPU per task, and one task runs a node's every worker).

    CPU nodes: a worker per CPU, as many as a node of the partition has (more only share them). GPU nodes: the
    node's CPUs in proportion to the GPUs the job takes (8 of 8: all of them), and at least one per worker and per
    loader process (``input.num_workers``), as many as a node has.
    """
    m = spec.cluster.devices_per_node
    most = max(partition.cpus) if partition and any(partition.cpus) else None
    if device == "cpu":
        return {"cpus_per_task": min(m, most or m)}
    needed = m * (1 + spec.input.num_workers)
    shares = [cpus * m // gpus for cpus, gpus in zip(partition.cpus, partition.gpus) if gpus >= m] if partition else []
    return {"cpus_per_task": min(max(needed, min(shares, default=0)), most or needed)}


def fits(params: dict[str, Any], spec: Any, partition: Partition | None) -> list[Problem]:
    """What no node of the partition can hold: sbatch accepts such a job, and it waits in the queue for ever."""
    if partition is None:  # sinfo could not tell: sbatch judges
        return []
    problems = []
    nodes, tasks = int(params["nodes"]), int(params.get("tasks_per_node") or 1)
    if nodes > sum(partition.nodes):
        problems.append(Problem(key="cluster", value=spec.cluster.shape, message=(
            f"partition {partition.name} has {sum(partition.nodes)} node(s) (sinfo) and cluster {spec.cluster.shape} needs {nodes}; "
            "SLURM would queue the job until the partition grows: use fewer nodes or another hydra.launcher.partition")))
    cpus = int(params.get("cpus_per_task") or 1) * tasks
    if partition.cpus and cpus > max(partition.cpus):
        problems.append(Problem(key="hydra.launcher.cpus_per_task", value=params.get("cpus_per_task"), message=(
            f"the nodes of partition {partition.name} have at most {max(partition.cpus)} CPUs (sinfo) and the job asks {cpus} per node; "
            "SLURM would queue it for ever: ask for fewer, or another hydra.launcher.partition")))
    return problems


def check_on_cpu(specs: list[Any], device: str, why: str) -> None:
    """Specs with ``cluster.device=auto`` were validated for GPU nodes (the submit host cannot see the compute
    nodes); when the partition has none, they are checked again for the CPU nodes they will run on."""
    from pydantic import ValidationError

    from launcher.config import pydantic_errors

    problems: list[Problem] = []
    for spec in specs if device == "cpu" else ():
        if spec.cluster.device != "auto":
            continue
        data = spec.model_dump()
        try:
            type(spec).model_validate(data, context={"cuda_devices": 0})
        except ValidationError as exc:
            problems += [p for p in pydantic_errors.problems(exc, type(spec), data) if p not in problems]
    if problems:
        raise ConfigError([*problems, Problem(key="cluster.device", value="auto", message=f"{why}: the jobs run on the CPU")])


def _auto_problem(message: str) -> ConfigError:
    return ConfigError([Problem(key="cluster.device", value="auto", message=message)])


def queue_defaults() -> dict[str, Any]:
    """hydra-submitit-launcher's own defaults for what the request shows (timeout_min, mem_gb, ...)."""
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    return {f.name: f.default for f in dataclasses.fields(SlurmQueueConf) if not callable(f.default_factory)}


_SHOWN = ("partition", "nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node", "gres", "mem_gb", "timeout_min")


def asked(params: dict[str, Any]) -> str:
    """The request in hydra.launcher's own names, one line, e.g. ``partition=debug nodes=1 ... timeout_min=60``."""
    return " ".join(f"{k}={params[k]}" for k in _SHOWN if params.get(k) not in (None, ""))


def request_rows(params: dict[str, Any], why_device: str, processes_per_node: int, jobs: int,
                 default: str | None = None) -> list[tuple[str, str]]:
    """The request as plan rows (shown before submitting, and in a dry run); ``default``: SLURM's default partition."""
    gpus = params.get("gpus_per_node")
    gres = f"gpu:{gpus} per node: {why_device}" if gpus else f"none: {why_device}"
    if params.get("gres"):
        gres = f"{params['gres']} (hydra.launcher.gres)"
    mem = f"{params['mem_gb']} GB per node" if params.get("mem_gb") else "SLURM's default (hydra.launcher.mem_gb)"
    return [
        ("partition", params.get("partition") or f"SLURM's default{f' ({default})' if default else ''}: hydra.launcher.partition chooses"),
        ("nodes", str(params["nodes"])),
        ("tasks", f"{params['tasks_per_node']} per node: one dlaunch node each, starting {processes_per_node} worker(s)"),
        ("cpus", f"{params['cpus_per_task']} per task" if params.get("cpus_per_task") else "SLURM's default per task"),
        ("gres", gres),
        ("memory", mem),
        ("time", f"{params['timeout_min']} min (hydra.launcher.timeout_min)"),
        ("jobs", f"{jobs}, as one sbatch job array" if jobs > 1 else "1"),
    ]


# What an sbatch message is about -> the override to change (first match wins).
_FIXES: tuple[tuple[tuple[str, ...], Callable[[dict[str, Any]], str]], ...] = (
    ((NOT_A_SUBMIT_HOST.lower(),), lambda p: "run it on a SLURM submit host (sbatch and srun on PATH), or hydra/launcher=submitit_local"),
    (("partition",), lambda p: "hydra.launcher.partition"),
    (("gres", "generic resource", "gpu"), lambda p: (
        "cluster.device=cpu, or hydra.launcher.partition=<a partition whose nodes have GPUs>"
        if p.get("gpus_per_node") else "hydra.launcher.gres")),
    (("time limit",), lambda p: "hydra.launcher.timeout_min"),
    (("account",), lambda p: "hydra.launcher.account"),
    (("qos",), lambda p: "hydra.launcher.qos"),
    (("memory",), lambda p: "hydra.launcher.mem_gb"),
    (("node configuration", "node count", "cpu"), lambda p: "cluster=NxM (nodes, devices per node) or hydra.launcher.cpus_per_task"),
)


def fix_for(said: str, params: dict[str, Any]) -> str:
    text = said.lower()
    for words, fix in _FIXES:
        if any(w in text for w in words):
            return fix(params)
    return "the hydra.launcher.* setting SLURM names above"


def render_refusal(params: dict[str, Any], said: str, console: Console) -> None:
    """sbatch's refusal on one screen: what was asked, what SLURM said, which override to change."""
    lines = [line.strip() for line in said.strip().splitlines() if line.strip()][-6:] or ["(no message)"]
    no_client = NOT_A_SUBMIT_HOST in said  # dlaunch's words, not SLURM's
    what, label = ("cannot submit from this machine", "why:") if no_client else ("SLURM refused the job", "SLURM said:")
    console.print(f"[bold red]dlaunch: {what}[/] (nothing was submitted)")
    console.print(f"  asked:       {escape(asked(params))}")
    for i, line in enumerate(lines):
        console.print(f"  {label if i == 0 else '':<12} {escape(line)}")
    console.print(f"  change:      {escape(fix_for(said, params))}")
    console.print("See docs/OPERATIONS.md (SLURM); `dlaunch ... launch.dry_run=true` shows the request without submitting.")


def _from_sbatch(exc: BaseException) -> bool:
    """submitit raises FailedJobError both for sbatch's refusal and for a job that failed; only the first has sbatch's exit."""
    cause = exc.__cause__
    return isinstance(cause, subprocess.CalledProcessError) and "sbatch" in str(cause.cmd)


class _QuietSacct(logging.Filter):
    """A cluster without accounting makes every submitit poll warn that sacct failed; the job's pickle still tells."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Bypassing sacct error" not in record.getMessage()


def submit_with_one_screen_refusals() -> None:
    """Make hydra-submitit-launcher's SLURM launcher report an sbatch refusal on one screen (exit 2), not as a traceback.

    Hydra instantiates only launchers that live in the ``hydra_plugins`` package, so dlaunch cannot name a
    subclass of its own in ``hydra.launcher._target_``; it wraps the plugin's ``launch`` in the submitting
    process instead (the jobs on the compute nodes never call it).
    """
    if getattr(_SubmititSlurmLauncher.launch, "_dlaunch", False):
        return
    plain = _SubmititSlurmLauncher.launch

    def launch(self: Any, job_overrides: Any, initial_job_idx: int) -> Any:
        from submitit.core.utils import FailedJobError

        logging.getLogger("submitit").addFilter(_QuietSacct())
        try:
            return plain(self, job_overrides, initial_job_idx)
        except FailedJobError as exc:
            if not _from_sbatch(exc):  # a job that ran and failed: its own report stands
                raise
            said = str(exc)  # submitit's text is sbatch's stderr
        except FileNotFoundError as exc:
            if exc.filename != "sbatch":
                raise
            said = f"cannot run sbatch: {exc.strerror} ({NOT_A_SUBMIT_HOST})"
        except RuntimeError as exc:  # submitit's SLURM executor looks for srun before it submits anything
            if 'Could not detect "srun"' not in str(exc):  # a job's own failure can mention srun: its report stands
                raise
            said = f"cannot find srun on PATH ({NOT_A_SUBMIT_HOST})"
        from launcher.cli import output

        render_refusal(self.params, said, output.messages())
        # Hydra prints any exception with a traceback; SystemExit passes through it to dlaunch's exit code.
        raise SystemExit(REFUSED_EXIT)

    launch._dlaunch = True  # type: ignore[attr-defined]
    _SubmititSlurmLauncher.launch = launch  # type: ignore[method-assign]
