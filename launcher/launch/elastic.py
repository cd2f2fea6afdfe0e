"""Start one worker process per device through torch.distributed.elastic.

This is the machinery torchrun uses: a ``LocalElasticAgent`` behind
``elastic_launch``, a c10d rendezvous (bound to the cluster's address), worker
monitoring, restarts and shutdown on failure or signal. dlaunch adds the worker
command, per-rank output tagging and the reading of failures.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Iterator

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from launcher.cluster.env import worker_environment
from launcher.config.schema import RunSpec
from launcher.launch import failures, rendezvous
from launcher.runtime import outputs

log = logging.getLogger("dlaunch")
WORKER_MODULE = "launcher.runtime.worker"


def write_job(spec: RunSpec, run_dir: Path, cuda_devices: int) -> Path:
    """The validated spec, as workers read it: they never run Hydra."""
    state = run_dir / outputs.STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    for stale in state.glob("rank-*.done"):  # a reused run directory must not vouch for this run
        stale.unlink()
    path = state / "job.json"
    path.write_text(json.dumps({"spec": spec.model_dump(mode="json"), "run_dir": str(run_dir.resolve()), "cuda_devices": cuda_devices}))
    return path


def launch_config(spec: RunSpec, run_dir: Path) -> LaunchConfig:
    return local_config(
        spec.cluster.devices_per_node, run_dir / "logs",
        addr=spec.cluster.master_addr, port=spec.cluster.master_port,
        max_restarts=spec.launch.max_restarts, join_timeout_s=spec.launch.rdzv_timeout_s,
        monitor_interval_s=spec.launch.monitor_interval_s, shutdown_grace_s=spec.launch.shutdown_grace_s,
    )


def local_config(
    nproc: int, log_dir: Path, *, addr: str = "127.0.0.1", port: int = 0, max_restarts: int = 0,
    join_timeout_s: int = 120, monitor_interval_s: float = 0.1, shutdown_grace_s: int = 5,
) -> LaunchConfig:
    """One node of ``nproc`` workers, rendezvous on ``addr:port`` (0: a free port)."""
    others = {r: Std.ALL for r in range(1, nproc)}
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"dlaunch-{uuid.uuid4().hex[:12]}",
        role="rank",
        rdzv_backend=rendezvous.register(),
        rdzv_endpoint=f"{addr}:{port}",
        rdzv_configs={"join_timeout": join_timeout_s, "last_call_timeout": 1},
        max_restarts=max_restarts,
        monitor_interval=monitor_interval_s,
        start_method="spawn",
        # Rank 0 keeps the terminal (its progress bar); the others are tagged and kept in logs/.
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=others, tee=others),
        log_line_prefix_template="[rank${rank}] ",
        local_addr=addr,
        shutdown_timeout=shutdown_grace_s,
    )


@contextlib.contextmanager
def _worker_env(extra: dict[str, str]) -> Iterator[None]:
    """The agent copies this process's environment into the workers'."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _quiet_agent() -> None:
    """The agent logs each failure itself; dlaunch reports the root cause once instead."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher")
    names = [n for n in logging.Logger.manager.loggerDict if n.startswith(prefixes)]
    for name in (*prefixes, *names):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(spec: RunSpec, run_dir: Path, cuda_devices: int) -> int:
    """Run the job's workers to the end; return the exit code (0, 1, or 128+signal)."""
    job = write_job(spec, run_dir, cuda_devices)
    config = launch_config(spec, run_dir)
    log.info("starting %d worker process(es) through torch.distributed.elastic", config.nproc_per_node)
    try:
        start_workers(config, WORKER_MODULE, job, single_node=spec.cluster.nodes == 1)
        return 0
    except ChildFailedError as exc:
        return report_child_failure(exc, spec, run_dir)
    except SignalException as exc:
        log.warning("stopped by %s; all workers were shut down", exc.sigval.name)
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        log.warning("interrupted; all workers were shut down")
        return 130
    except RendezvousError as exc:
        log.error("the workers could not meet: %s", exc)
        return 1
    except OSError as exc:  # e.g. cluster.master_port already in use, an address that does not resolve
        log.error("cannot start the rendezvous on %s:%s: %s", spec.cluster.master_addr, spec.cluster.master_port, exc)
        return 1


def start_workers(config: LaunchConfig, module: str, job: Path, single_node: bool) -> None:
    """``python -m module job`` on every worker, under the elastic agent; raises on failure."""
    _quiet_agent()
    with _worker_env(worker_environment(single_node=single_node)):
        elastic_launch(config, sys.executable)("-u", "-m", module, str(job))


def report_child_failure(exc: ChildFailedError, spec: RunSpec, run_dir: Path) -> int:
    """Show the root cause once; a rank that died after completing does not fail the run."""
    causes = {rank: failures.from_process_failure(rank, f) for rank, f in exc.failures.items()}
    finished = {r for r in causes if outputs.completion_marker(run_dir, r).exists()}
    real = [c for r, c in causes.items() if r not in finished]
    if not real:
        ranks = ", ".join(f"rank {r} ({causes[r].exit})" for r in sorted(finished))
        log.warning("%s ended abnormally during teardown after completing; the run completed", ranks)
        return 0
    root = failures.first(real)
    others = [c for c in causes.values() if c.rank != root.rank]
    failures.render(root, others, last_logged_step(run_dir))
    record_failure(spec, run_dir, root)
    return 1


def logged(run_dir: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (run_dir / outputs.METRICS).read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def last_logged_step(run_dir: Path) -> int | None:
    records = logged(run_dir)
    return int(records[-1]["step"]) if records else None


def record_failure(spec: RunSpec, run_dir: Path, root: failures.RootCause) -> None:
    """A failed run's summary.json: the same keys as a completed one, plus the root cause."""
    records = logged(run_dir)
    summary = {
        "status": "failed",
        "strategy": spec.strategy.name,
        "recipe": spec.recipe.name,
        "cluster": spec.cluster.shape,
        "num_replicas_in_sync": spec.num_replicas,
        "world_size": spec.cluster.world_size if spec.num_replicas > 1 else 1,
        "global_batch_size": spec.input.global_batch_size,
        "steps": spec.trainer.steps,
        "first_loss": records[0]["loss"] if records else None,
        "final_loss": records[-1]["loss"] if records else None,
        "examples_per_sec": records[-1]["examples_per_sec"] if records else None,
        "wall_seconds": None,
        "param_norm": None,
        "metrics": {},
        "last_logged_step": last_logged_step(run_dir),
        "error": root.as_dict(),
    }
    outputs.write_json_atomic(run_dir / outputs.SUMMARY, summary)
