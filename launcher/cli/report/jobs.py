"""Reading run directories for ``dlaunch report``: each one's metrics, summary, overrides and root cause."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from launcher.config.metric_names import lower_by_name
from launcher.runtime import outputs

STANDARD_KEYS = ("step", "loss", "examples_per_sec", "time")  # what every metrics.jsonl record carries


class ReportError(Exception):
    """Nothing to report on; the message is the whole explanation (one line)."""


@dataclass
class Job:
    """One run directory: a lone run, or one job of a sweep."""

    name: str
    path: Path
    overrides: list[str]
    records: list[dict[str, Any]]
    summary: dict[str, Any] | None
    label: str = ""  # the chart label: the overrides that set this job apart from the others
    root_cause: str = ""  # the block the terminal showed when the run failed (error.txt), if it was kept

    @property
    def status(self) -> str:
        if self.summary is None:
            return "no summary.json: killed (SIGKILL, out of memory) or still running"
        return str(self.summary.get("status") or "unknown")

    @property
    def completed(self) -> bool:
        return self.summary is not None and self.summary.get("status") == "completed"

    @property
    def stopped(self) -> bool:
        """Stopped by a signal after its save (``dlaunch resume`` goes on), or a sweep's job not started after that."""
        return self.summary is not None and self.summary.get("status") in outputs.CUT_SHORT

    @property
    def metrics(self) -> dict[str, Any]:
        found = (self.summary or {}).get("metrics")
        return found if isinstance(found, dict) else {}

    @property
    def exception(self) -> str:
        """The failure's one line (``ValueError: boom``), or the process's exit when it left no exception."""
        error = (self.summary or {}).get("error")
        if not isinstance(error, dict):
            return ""
        return str(error.get("exception") or error.get("exit") or "")

    @property
    def script(self) -> str:
        """The command of a ``script=`` run (it logs its own metrics; dlaunch records none), else ""."""
        return str((self.summary or {}).get("script") or "")

    @property
    def best(self) -> dict[str, Any] | None:
        """The best evaluation's checkpoint (trainer.checkpoint.best): metric, value, step, checkpoint; else None."""
        found = (self.summary or {}).get("best")
        return found if isinstance(found, dict) and _number(found.get("value")) is not None else None

    @property
    def has_loss(self) -> bool:
        return any(_number(r.get("loss")) is not None and _number(r.get("step")) is not None for r in self.records)

    def describe(self) -> str:
        """recipe, strategy and cluster, as the summary (or the config a killed run left) names them."""
        return " · ".join(f for f in self.facts() if f)

    def facts(self) -> tuple[str | None, str | None, str | None]:
        """(recipe, strategy, cluster), each None where nothing this directory holds says it. A job that never
        started (refused by its config, or after a stop) has only Hydra's record of its composed config."""
        s = self.summary or {}
        found = [s.get("recipe") or self.script.split(" ")[0] or None, s.get("strategy"), s.get("cluster")]
        for config in (_config(self.path), _config(self.path / outputs.HYDRA_RECORD)):
            if all(found):
                break
            cluster, script = config.get("cluster") or {}, (config.get("script") or {}).get("path")
            fallback = [Path(script).name if script else (config.get("recipe") or {}).get("name"),
                        (config.get("strategy") or {}).get("name"),
                        f"{cluster['nodes']}x{cluster['devices_per_node']}"
                        if "nodes" in cluster and "devices_per_node" in cluster else None]
            found = [f or _plain(b) for f, b in zip(found, fallback)]
        recipe, strategy, cluster = (str(f) if f else None for f in found)
        return recipe, strategy, cluster

    def evaluation_losses(self) -> list[str]:
        """The losses the recipe's ``evaluate`` returned (``eval_loss``): keys ending in ``loss`` of the records
        that hold no training loss (an evaluation's record is its step and its metrics)."""
        found = {k for r in self.records if "loss" not in r for k in r if k.endswith("loss")}
        return sorted(k for k in found if any(_number(r.get(k)) is not None for r in self.records))

    def resumes(self) -> list[int]:
        """The steps this run's commands resumed from, since it began afresh."""
        return outputs.resumed_steps(self.path)

    def curve(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of one metrics.jsonl key; a null value is a gap (nan). Records without the key
        (an evaluation's among the training steps') are not points of its curve."""
        steps, values = [], []
        for r in self.records:
            step = _number(r.get("step"))
            if step is None or key not in r:
                continue
            value = _number(r.get(key))
            steps.append(step)
            values.append(math.nan if value is None else value)
        return steps, values


def sweep_jobs(directory: Path) -> list[Path]:
    """A sweep's job directories, in job order: numbered ones, or (a custom hydra.sweep.subdir) any run directory."""
    if is_run(directory):
        return []  # a run directory, even if it holds numbered folders of its own
    listed = _summarized(directory)
    if listed is not None:  # the sweep's own jobs: an earlier sweep's in the same directory are not charted
        return [directory / name for name in listed if (directory / name).is_dir()]
    subdirs = [d for d in directory.iterdir() if d.is_dir() and not d.name.startswith(".")]
    numbered = sorted((d for d in subdirs if d.name.isdigit()), key=lambda d: int(d.name))
    if numbered:
        return numbered
    if not (directory / "multirun.yaml").exists():
        return []
    return sorted(d for d in subdirs if any((d / n).exists() for n in (outputs.METRICS, outputs.SUMMARY, outputs.HYDRA_RECORD)))


def _summarized(directory: Path) -> list[str] | None:
    """The job directories ``sweep_summary.json`` lists, by name, in its order (None: no readable summary)."""
    try:
        return [Path(job["dir"]).name for job in _sweep_summary(directory)["jobs"]]
    except (KeyError, TypeError):
        return None


def study_direction(directory: Path, metric: str) -> str | None:
    """The ``direction`` of the Optuna study a sweep ran, as its ``sweep_summary.json`` records it, where ``metric`` is
    what the study optimized (its ``objective``): a minimized final loss says nothing of an accuracy."""
    summary = _sweep_summary(directory)
    if not isinstance(summary, dict) or summary.get("objective") not in (None, metric):
        return None
    return summary.get("direction")


def _sweep_summary(directory: Path) -> Any:
    import json

    try:
        return json.loads((directory / outputs.SWEEP_SUMMARY).read_text())
    except (OSError, ValueError):
        return None


def is_run(directory: Path) -> bool:
    return (directory / outputs.METRICS).exists() or (directory / outputs.SUMMARY).exists()


def load(path: Path, name: str) -> Job:
    try:
        root_cause = (path / outputs.ERROR).read_text(encoding="utf-8").rstrip()
    except OSError:
        root_cause = ""
    return Job(name=name, path=path, overrides=_overrides(path),
               records=outputs.latest_timeline([r for r in outputs.read_records(path / outputs.METRICS)
                                                if isinstance(r, dict)]),
               summary=_summary(path), root_cause=root_cause)


def label(jobs: list[Job]) -> None:
    """Label each job by the overrides that differ across the sweep (all of them when none differ)."""
    common = set.intersection(*(set(j.overrides) for j in jobs)) if jobs else set()
    for j in jobs:
        own = [o for o in j.overrides if o not in common] or j.overrides
        j.label = f"{j.name}: {' '.join(own)}" if own else f"job {j.name}"


def extra_keys(records: list[dict[str, Any]]) -> list[str]:
    """Numeric keys of metrics.jsonl records beyond the standard four (lr, grad_norm, eval_*), first-seen order."""
    keys: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k not in STANDARD_KEYS and _number(v) is not None:
                keys.setdefault(k, None)
    return list(keys)


def final_value(job: Job, metric: str) -> float | None:
    return _number(outputs.metric_value(job.summary, metric))


def _summary(path: Path) -> dict[str, Any] | None:
    found = outputs.read_summary(path)
    return found if isinstance(found, dict) else None


def _yaml(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _overrides(path: Path) -> list[str]:
    """The job's overrides as typed, without the ``trainer.resume=auto`` (the default) that ``dlaunch resume`` adds:
    a job of a sweep resumed alone was labelled by it, the one override that set it apart."""
    from launcher.cli.resume import ADDED
    from launcher.config.user_recipes import as_shown

    found = _yaml(path / outputs.HYDRA_RECORD / "overrides.yaml")
    return [o for o in as_shown(str(o) for o in found) if o != ADDED] if isinstance(found, list) else []


def _config(path: Path) -> dict[str, Any]:
    found = _yaml(path / outputs.CONFIG)
    return found if isinstance(found, dict) else {}


def _plain(value: Any) -> Any:
    """A value of a composed config as written, or None for an interpolation it left unresolved (``${...}``)."""
    return None if "${" in str(value) else value


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def best_said(best: dict[str, Any]) -> str:
    """``eval_loss=0.0121834 at step 140: RUN/checkpoints/step-00000140`` (a summary's ``best``)."""
    return f"{best['metric']}={best['value']:.6g} at step {best['step']}: {best['checkpoint']}"


# --- which job is best ---------------------------------------------------------------------------------------------

STUDY_DIRECTIONS = {"minimize": True, "maximize": False}  # an Optuna study's hydra.sweeper.direction: lower is better?


def lower_is_better(metric: str, direction: str | None = None) -> bool | None:
    """Whether a lower ``metric`` is better: an Optuna study's ``direction`` where given, else the metric's name (None:
    neither tells)."""
    if direction in STUDY_DIRECTIONS:
        return STUDY_DIRECTIONS[direction]
    return lower_by_name(metric)


def fixed_format(values: list[float], digits: int = 3) -> str:
    """One format for every value of a chart: ``digits`` significant digits of the smallest magnitude, so that
    0.5 and 0.0123 print as 0.5000 and 0.0123 (scientific when the values are tiny or huge)."""
    finite = [abs(v) for v in values if math.isfinite(v) and v != 0]
    if not finite:
        return ".0f"
    smallest, largest = min(finite), max(finite)
    if smallest < 1e-4 or largest >= 1e7:
        return f".{digits - 1}e"
    return f".{max(0, digits - 1 - math.floor(math.log10(smallest)))}f"


def best(values: list[tuple[Any, float]], lower: bool | None, shown: Callable[[float], str]) -> list[Any]:
    """What each of ``values`` ranks (a job, its number) whose value, as ``shown`` prints it, equals the best one's: a
    tie as the reader sees it is a tie. None where no direction is known (``lower`` None), under two values, or every
    value tied: no job to point at. The report's chart and the sweep's table rank with it alike."""
    if lower is None or len(values) < 2:
        return []
    top = shown((min if lower else max)(v for _, v in values))
    tops = [item for item, v in values if shown(v) == top]
    return tops if len(tops) < len(values) else []
