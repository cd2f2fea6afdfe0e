"""The run directory contract: ``config.yaml``, ``metrics.jsonl``, ``summary.json`` (and a failed run's ``error.txt``).

Other tools and tests read these files; keep the keys stable.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
HYDRA_RECORD = ".hydra"  # the job's command as Hydra records it (config, hydra, overrides YAML): resume and sweeps read it
SCRIPT_ARGS = "script_args.json"  # in HYDRA_RECORD: a script's own arguments (after --), which are no override
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
SWEEP_SUMMARY = "sweep_summary.json"  # in a sweep's directory: its table, each job's params, the best job
ERROR = "error.txt"  # a failed run's root-cause block, as the terminal showed it
STATE_DIR = ".dlaunch"  # launcher bookkeeping: the worker job file, per-rank completion markers and progress
TOKEN = "token"  # in STATE_DIR, owner-only: the cluster.token node 0 made, taken again when the run resumes
HISTORY = "history.jsonl"  # in STATE_DIR: each command and each start of the workers since the run began afresh
UNSAVED_STOP = "unsaved-stop.json"  # in STATE_DIR: the checkpoint of a stop that the storage refused (on_error=warn)
# The keys of a metrics.jsonl training record that dlaunch writes: a recipe's own metrics take other names.
RESERVED_METRICS = frozenset({"step", "loss", "lr", "grad_norm", "examples_per_sec", "time", "skipped_steps"})


def is_group_lr(name: str) -> bool:
    """A parameter group's own rate in a record (``lr_group1``): the first group's is ``lr``."""
    return name.startswith("lr_group") and name[len("lr_group"):].isdigit()


def is_reserved(name: str) -> bool:
    """A key of dlaunch's own records: ``RESERVED_METRICS``, or another parameter group's rate (``lr_group1``)."""
    return name in RESERVED_METRICS or is_group_lr(name)


def start_run(run_dir: Path, resuming: bool = False, script: bool = False) -> None:
    """A reused run directory must not show the previous run's results as this one's.

    A run that resumes from a checkpoint keeps its metrics: the curve continues. ``script``: the directory's last run
    was of the same script, which keeps them and the history: ``metrics.jsonl`` is the script's own file, and only
    the script knows whether it resumes (``ScriptCheckpoints.restore`` records it when it does).
    """
    (run_dir / SUMMARY).unlink(missing_ok=True)
    (run_dir / ERROR).unlink(missing_ok=True)
    (run_dir / STATE_DIR / UNSAVED_STOP).unlink(missing_ok=True)
    for note in (run_dir / STATE_DIR).glob("rank-*.teardown"):  # an earlier command's: this one's stops are stops
        note.unlink(missing_ok=True)
    if not resuming and not script:
        (run_dir / METRICS).unlink(missing_ok=True)
        (run_dir / STATE_DIR / HISTORY).unlink(missing_ok=True)


def same_script(run_dir: Path, path: str) -> bool:
    """Whether the run recorded in ``run_dir`` (its ``config.yaml``) ran the script at ``path``."""
    import yaml

    try:
        config = yaml.safe_load((run_dir / CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return False
    script = config.get("script") if isinstance(config, dict) else None
    return isinstance(script, dict) and script.get("path") == path


def snapshot_record(run_dir: Path) -> dict[Path, bytes | None] | None:
    """The run's command as recorded (Hydra's record, ``config.yaml``) now, or None where there is none yet:
    ``restore_record`` puts it back when a command that went ahead in the directory trained nothing."""
    hydra = [run_dir / HYDRA_RECORD / name for name in ("config.yaml", "hydra.yaml", "overrides.yaml", SCRIPT_ARGS)]
    if not (run_dir / HYDRA_RECORD / "overrides.yaml").is_file():
        return None
    return {path: path.read_bytes() if path.is_file() else None for path in (*hydra, run_dir / CONFIG)}


def touch_record(run_dir: Path) -> None:
    """Hydra's record of the run's command, as it is, marked as this command's (the sweep table's test)."""
    record = run_dir / HYDRA_RECORD / "overrides.yaml"
    if record.is_file():
        os.utime(record)


def restore_record(snapshot: dict[Path, bytes | None]) -> None:
    for path, data in snapshot.items():
        if data is None:
            path.unlink(missing_ok=True)
        else:
            write_atomic(path, data)


def record_command(run_dir: Path) -> None:
    """A ``dlaunch`` command is about to start this run's workers (node 0's launcher says so once per command)."""
    _append_history(run_dir, {"event": "command", "pid": os.getpid(), "time": time.time()})


def record_start(run_dir: Path, restart: int, resumed_from_step: int) -> None:
    """The workers started (``restart``: the agent's restart count) and loaded ``resumed_from_step`` (0: none)."""
    _append_history(run_dir, {"event": "start", "restart": restart, "resumed_from_step": resumed_from_step, "time": time.time()})


def record_resume(run_dir: Path, step: int) -> None:
    """A script's workers restored its checkpoint of ``step`` (``ScriptCheckpoints.restore``, on rank 0)."""
    _append_history(run_dir, {"event": "resumed", "step": step, "time": time.time()})


def history(run_dir: Path) -> dict[str, int]:
    """What it took to get here since the run began afresh, for summary.json.

    ``commands``: dlaunch commands that started workers; ``restarts``: elastic
    restarts of the workers (after a worker failed), over all those commands;
    ``resumes``: starts of the workers that continued from a checkpoint.
    """
    events = read_records(run_dir / STATE_DIR / HISTORY)
    starts = [e for e in events if e.get("event") == "start"]
    return {
        "commands": sum(e.get("event") == "command" for e in events),
        "restarts": sum(bool(e.get("restart")) for e in starts),
        "resumes": sum(bool(e.get("resumed_from_step")) for e in starts)
                   + sum(e.get("event") == "resumed" for e in events),  # a script's, from ScriptCheckpoints
    }


def resumed_steps(run_dir: Path) -> list[int]:
    """The step each start of the workers continued from (a script's restore included), in order."""
    events = read_records(run_dir / STATE_DIR / HISTORY)
    return [int(e["resumed_from_step"] if e.get("event") == "start" else e["step"]) for e in events
            if (e.get("event") == "start" and e.get("resumed_from_step")) or (e.get("event") == "resumed" and "step" in e)]


def command_restarts(run_dir: Path) -> int:
    """Elastic restarts of the workers in this dlaunch command (summary.json's ``restarts``, as a completed run's)."""
    events = read_records(run_dir / STATE_DIR / HISTORY)
    last = max((i for i, e in enumerate(events) if e.get("event") == "command"), default=-1)
    return sum(bool(e.get("restart")) for e in events[last + 1:] if e.get("event") == "start")


def since_start(run_dir: Path) -> float | None:
    """Seconds since this command's workers last started (rank 0's ``start`` event, once it had built and resumed):
    a failed or stopped run's ``wall_seconds``. None where they never got that far (a build error)."""
    events = read_records(run_dir / STATE_DIR / HISTORY)
    last = max((i for i, e in enumerate(events) if e.get("event") == "command"), default=-1)
    starts = [e["time"] for e in events[last + 1:] if e.get("event") == "start" and isinstance(e.get("time"), (int, float))]
    return max(0.0, time.time() - starts[-1]) if starts else None


def _append_history(run_dir: Path, event: dict[str, Any]) -> None:
    path = run_dir / STATE_DIR / HISTORY
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:  # one short line per write: a killed writer leaves at most a torn last line
        fh.write(json.dumps(event) + "\n")


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """All or nothing: a reader never sees half a file, and a failed write (a full disk) leaves no ``.tmp``.

    The top-level keys are sorted; a nested dict keeps its order (``metrics``: the order the recipe's ``evaluate``
    returned them in, whose first is what a sweep ranks its jobs by when ``sweep.objective`` is not given)."""
    write_atomic(path, (json.dumps(_finite(dict(sorted(data.items()))), indent=2) + "\n").encode())


DEFAULT_OBJECTIVE = "final_loss"  # sweep.objective's default (config/schema.py)


def ranking_metric(run_dir: Path, summary: dict[str, Any] | None) -> str | None:
    """What a sweep's table and ``dlaunch report`` rank the job in ``run_dir`` by: its ``sweep.objective`` where one
    was given (the default, final_loss, counts as given when an override names it), else the first metric its
    recipe's ``evaluate`` returned; None: neither (the final loss, then)."""
    import yaml

    try:
        config = yaml.safe_load((run_dir / CONFIG).read_text())
        overrides = yaml.safe_load((run_dir / HYDRA_RECORD / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        config, overrides = None, None
    objective = ((config or {}).get("sweep") or {}).get("objective") if isinstance(config, dict) else None
    named = isinstance(overrides, list) and any(str(o).lstrip("+").startswith("sweep.objective=") for o in overrides)
    if isinstance(objective, str) and (objective != DEFAULT_OBJECTIVE or named):
        return objective
    if isinstance(config, dict) and config.get("script"):  # its metrics come in the order it logged them (an epoch
        return None                                        # count first, maybe): its final loss ranks it
    metrics = (summary or {}).get("metrics")
    return next(iter(metrics), None) if isinstance(metrics, dict) else None


def metric_value(summary: dict[str, Any] | None, name: str) -> Any:
    """The job's value of ``name``: its summary's ``final_loss``, or a metric its recipe reported (None: none)."""
    if name == DEFAULT_OBJECTIVE:
        return (summary or {}).get(DEFAULT_OBJECTIVE)
    metrics = (summary or {}).get("metrics")
    return metrics.get(name) if isinstance(metrics, dict) else None


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


CUT_SHORT = ("stopped", "not started")  # statuses of a run a signal stopped, and of a sweep's jobs after it


def completed(run_dir: Path) -> bool:
    """The run in ``run_dir`` completed (its summary.json says so)."""
    return (read_summary(run_dir) or {}).get("status") == "completed"


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / SUMMARY
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


class MetricsLog:
    """One JSON object per logged step, and one per evaluation (``{"step": N, "eval_loss": ...}``).

    A run resumed at step ``resumed_at`` keeps the records up to that step and
    continues after them (records of steps it will redo are dropped); a fresh run
    starts an empty file.
    """

    def __init__(self, path: Path, resumed_at: int = 0):
        self.kept = [r for r in read_records(path) if r.get("step", 0) <= resumed_at] if resumed_at else []
        tmp = path.with_suffix(path.suffix + ".tmp")  # the kept curve is replaced in one rename, never truncated
        tmp.write_text("".join(json.dumps(_finite(r)) + "\n" for r in self.kept))
        os.replace(tmp, path)
        self._file = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_finite(record)) + "\n")

    def close(self) -> None:
        self._file.close()


def append_evaluation(path: Path, step: int, metrics: dict[str, float]) -> None:
    """The end-of-run evaluation as a record of its own, as ``trainer.eval_every``'s are (the curve's last point), once:
    a resume with nothing left to train finds the record of the run it resumed."""
    if any(r.get("step") == step and "examples_per_sec" not in r for r in read_records(path, tail=4)):
        return
    with path.open("a") as fh:
        fh.write(json.dumps(_finite({"step": step, **metrics})) + "\n")


def read_records(path: Path, tail: int = 0) -> list[dict[str, Any]]:
    """The records of a metrics file (``tail``: its last ones, read from its end); a torn last line (a killed writer)
    is left out."""
    try:
        with path.open("rb") as fh:
            if tail:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - 4096 * tail))
            lines = fh.read().decode(errors="replace").splitlines()[-tail:]
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def latest_timeline(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of a run's last timeline. A resumed script logs steps again from its checkpoint on: a record whose
    step is not past the last one of records with its keys replaces those of its keys from its step on. Records of
    other keys (an epoch's evaluation beside the steps' losses) count their steps apart. dlaunch's own loop drops
    them itself when it resumes (``MetricsLog``)."""
    kept: list[dict[str, Any]] = []
    last: dict[frozenset[str], float] = {}  # the last step logged with each set of keys
    for record in records:
        step, keys = record.get("step"), frozenset(record)
        if _is_number(step):
            if keys in last and step <= last[keys]:
                kept = [r for r in kept if not (frozenset(r) == keys and r["step"] >= step)]
            last[keys] = step
        kept.append(record)
    return kept


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def script_results(run_dir: Path) -> dict[str, Any]:
    """What a script's own ``metrics.jsonl`` says of its run, for its summary (a sweep's table and objective read
    them as a recipe run's): the last ``loss`` and its step, and the last value of each key of the script's own
    (``eval_accuracy``; not dlaunch's ``lr`` or ``grad_norm``)."""
    results: dict[str, Any] = {}
    metrics: dict[str, float] = {}
    for record in latest_timeline(read_records(run_dir / METRICS)):
        if _finite_number(record.get("loss")) and _finite_number(record.get("step")):
            results.update(final_loss=record["loss"], last_logged_step=record["step"])
        metrics.update({k: v for k, v in record.items() if not is_reserved(k) and _finite_number(v)})
    return {**results, **({"metrics": metrics} if metrics else {})}


def last_loss(run_dir: Path) -> tuple[float, int] | None:
    """The last ``loss`` a run logged and its step (None: none): what a run that failed or was stopped got to (its
    summary's ``last_logged_loss``; no final loss), which may be of a step long before the failure."""
    found = None
    for record in latest_timeline(read_records(run_dir / METRICS)):
        if _finite_number(record.get("loss")) and _finite_number(record.get("step")):
            found = (float(record["loss"]), int(record["step"]))
    return found


def loss_at(loss: float, step: int) -> str:
    """``0.995488 (step 1)``: a run's last logged loss, as the sweep table and the report show it."""
    return f"{loss:.6g} (step {step})"


def _finite_number(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


def completion_marker(run_dir: Path, rank: int) -> Path:
    return run_dir / STATE_DIR / f"rank-{rank}.done"


def teardown_note(run_dir: Path, rank: int) -> Path:
    """Written by a rank's agent just before it stops the rank for a failure (its node's or another's): the SIGTERM
    that follows is a teardown, which dlaunch reports once, not a stop the rank saves for and announces."""
    return run_dir / STATE_DIR / f"rank-{rank}.teardown"


def teardown_marker(run_dir: Path) -> Path:
    """Made by dlaunch before it stops the node agents (or tasks) that outlived another's failure: their SIGTERM is
    then a teardown (``launch.shutdown_grace_s``), not a stop whose workers save (``launch.stop_grace_s``)."""
    return run_dir / STATE_DIR / "teardown"


def torn_down(run_dir: Path, rank: int) -> bool:
    """A stop signal reaching rank ``rank`` now is a failure's teardown: its agent's, or dlaunch's of the whole job."""
    return teardown_note(run_dir, rank).exists() or teardown_marker(run_dir).exists()


def progress_file(run_dir: Path, rank: int) -> Path:
    """A rank's last heartbeat record (``step``: its last completed step), rewritten about once a second."""
    return run_dir / STATE_DIR / f"rank-{rank}.progress.json"


def read_progress(run_dir: Path, rank: int) -> dict[str, Any]:
    """A rank's last heartbeat record (``step``, ``operation``, ``where``, ``pid``, ``host``, ``beat``); {} where it
    has none (no heartbeat yet, a script) or it cannot be read."""
    try:
        record = json.loads(progress_file(run_dir, rank).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def record_unsaved_stop(run_dir: Path, step: int, why: str) -> None:
    """The checkpoint of a stop at ``step`` was not saved, and ``why`` (for ``unsaved_stop``); unsaid where the run
    directory cannot hold it (then the workers' log alone says so)."""
    with contextlib.suppress(OSError):
        (run_dir / STATE_DIR).mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_dir / STATE_DIR / UNSAVED_STOP, {"step": step, "why": why})


def unsaved_stop(run_dir: Path, checkpoint_step: int | None) -> dict[str, Any] | None:
    """The stop's checkpoint that the storage refused (``step``, ``why``), where it is later than ``checkpoint_step``,
    the one a resume goes on from (an older record, of a stop before a restart that saved later, is not)."""
    try:
        lost = json.loads((run_dir / STATE_DIR / UNSAVED_STOP).read_text())
    except (OSError, ValueError):
        return None
    return lost if checkpoint_step is None or int(lost["step"]) > checkpoint_step else None


def last_completed_step(run_dir: Path, rank: int) -> int | None:
    """The last completed step a rank's heartbeat recorded, or None."""
    try:
        return int(read_progress(run_dir, rank)["step"])
    except (KeyError, ValueError, TypeError):
        return None


def _finite(data: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_finite(v) for v in data]
    return data
