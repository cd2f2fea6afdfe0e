"""A sweep's results as the user reads them: the terminal table with its best job, and the JSON and CSV files.

    sweep summary: 3 jobs
    every job: trainer.steps=200
    job  overrides                status     final loss  metric               examples/s  wall s
      0  recipe.optimizer.lr=0.1  completed    0.0512    eval_loss 0.0498           8121    1.52
    ...
    best: job 0 (recipe.optimizer.lr=0.1): eval_loss 0.0498 (lower is better)

``sweep_summary.csv`` has a column per swept key (``recipe.optimizer.lr``), so a table tool groups by it;
``sweep_summary.json`` has each job's ``params`` and the sweep's ``best``.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from launcher.config.overrides import key_of
from launcher.runtime import outputs

COLUMNS = ("job", "overrides", "status", "final_loss", "last_logged_loss", "last_logged_step", "metric", "metric_value",
           "examples_per_sec", "wall_seconds",
           "resumed_from_step")  # set: the last command went on from that checkpoint, and the throughput and time are its
_CUT_SHORT = outputs.CUT_SHORT  # a signal stopped the sweep: shown by name, in yellow, not as failures


def params(overrides: list[str]) -> dict[str, str]:
    """A job's ``key=value`` overrides by key, as typed (``+``, ``++`` and ``~`` dropped; a script's ``-- ...`` is
    not one)."""
    return {key_of(item): item.partition("=")[2] for item in overrides if "=" in item and not item.startswith("-")}


def swept_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The keys whose value differs between the jobs (or that some jobs lack), in the order they were typed."""
    all_params = [r.get("params") or {} for r in rows]
    keys = list(dict.fromkeys(k for p in all_params for k in p))
    return [k for k in keys if len({p.get(k) for p in all_params}) > 1 and k not in COLUMNS]


def shared_overrides(rows: list[dict[str, Any]]) -> list[str]:
    """The overrides every job has: shown once above the table, not in each row."""
    lists = [r["_overrides"] for r in rows]
    return [o for o in lists[0] if all(o in other for other in lists[1:])] if lists else []


def best(rows: list[dict[str, Any]], direction: str | None = None, objective: str | None = None) -> dict[str, Any] | None:
    """The completed jobs with the best value of the metric they all rank by (``sweep.objective``, else the first
    metric their recipe's evaluate returned, else the final loss), ties as printed counted equal: ``{"metric",
    "lower_is_better", "value", "jobs"}``. None: under two such jobs, all of them tied, jobs ranked by different
    metrics (a sweep over recipes), or a metric whose name does not tell which way is better (Optuna's ``direction``
    does, where given)."""
    from launcher.cli.report.jobs import best as ranked, lower_is_better

    done = [r for r in rows if r["status"] == "completed"]
    names = {r["metric"] or outputs.DEFAULT_OBJECTIVE for r in done}
    if len(names) != 1:
        return None
    name = names.pop()
    lower = lower_is_better(name, direction if objective in (None, name) else None)  # the study ranks its objective
    values = [(r["job"], r["metric_value"] if r["metric"] else r["final_loss"]) for r in done]
    values = [(job, float(v)) for job, v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    jobs = ranked(values, lower, _num)
    if not jobs:
        return None
    return {"metric": name, "lower_is_better": lower, "value": (min if lower else max)(v for _, v in values),
            "jobs": jobs}


def show(rows: list[dict[str, Any]], sweep_dir: Path, console: Console, direction: str | None = None,
         objective: str | None = None) -> None:
    failed = sum(r["status"] != "completed" for r in rows)
    shared = shared_overrides(rows)
    counts = [(sum(r["status"] not in ("completed", *_CUT_SHORT) for r in rows), "failed"),
              *((sum(r["status"] == status for r in rows), status) for status in _CUT_SHORT)]
    title = f"sweep summary: {len(rows)} job{'s' if len(rows) != 1 else ''}" + "".join(f", {n} {what}" for n, what in counts if n)
    table = Table(title=title, title_justify="left", box=None, padding=(0, 2))
    columns = ("job", "overrides", "status", "final loss", "metric", "examples/s", "wall s") + (("reason",) if failed else ())
    for column in columns:
        table.add_column(column, justify="right" if column in ("job", "final loss", "examples/s", "wall s") else "left",
                         overflow="fold")
    top = best(rows, direction, objective)
    for r in rows:
        status = r["status"] if r["status"] == "completed" else f"[{'yellow' if r['status'] in _CUT_SHORT else 'red'}]{r['status']}[/]"
        metric = f"{r['metric']} {_num(r['metric_value'])}" if r["metric"] else ""
        own = " ".join(o for o in r["_overrides"] if o not in shared)
        why = [escape(r.get("error") or "")] if failed else []
        part = "*" if r.get("resumed_from_step") else ""
        job = f"[bold green]{r['job']}[/]" if top and r["job"] in top["jobs"] else str(r["job"])
        table.add_row(job, escape(own), status, _loss(r), metric,
                      _num(r["examples_per_sec"], ".0f") + part, _num(r["wall_seconds"], ".2f") + part, *why)
    if shared:
        console.print(f"every job: {escape(' '.join(shared))}")
    console.print(table)
    if top:
        console.print(_best_line(rows, top, shared))
    resumed = [f"job {r['job']} from step {r['resumed_from_step']}" for r in rows if r.get("resumed_from_step")]
    if resumed:
        console.print(f"* resumed ({', '.join(resumed)}): examples/s and wall s cover only the steps its last command "
                      "trained after that checkpoint, not the job as a whole")
    console.print(f"sweep results: [bold]{sweep_dir}[/] (sweep_summary.json, sweep_summary.csv, one directory per job)")


def _best_line(rows: list[dict[str, Any]], top: dict[str, Any], shared: list[str]) -> str:
    """``best: job 2 (recipe.optimizer.lr=0.1), eval_accuracy 0.93 (higher is better)``; ties named together."""
    by_job = {r["job"]: r for r in rows}
    named = [f"{job} ({' '.join(o for o in by_job[job]['_overrides'] if o not in shared)})" for job in top["jobs"]]
    who = f"job {named[0]}" if len(named) == 1 else f"jobs {', '.join(named)}, tied"
    way = "lower" if top["lower_is_better"] else "higher"
    return escape(f"best: {who}: {top['metric']} {_num(top['value'])} ({way} is better)")


def write(sweep_dir: Path, rows: list[dict[str, Any]], direction: str | None = None, objective: str | None = None) -> None:
    """``sweep_summary.json`` (every row, each job's ``params``, the sweep's ``best`` and an Optuna study's
    ``direction``) and ``sweep_summary.csv`` (a column per swept key after the job's number), each written whole."""
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    for row in public:
        row.setdefault("params", params((row.get("overrides") or "").split()))  # a row of an older summary
    summary = {"sweep_dir": str(sweep_dir.resolve()), "direction": direction, "objective": objective,
               "best": best(rows, direction, objective), "jobs": public}
    outputs.write_json_atomic(sweep_dir / outputs.SWEEP_SUMMARY, summary)  # absolute: read from anywhere, after a resume too
    keys = swept_keys(public)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=[COLUMNS[0], *keys, *COLUMNS[1:], "error", "dir"], extrasaction="ignore")
    writer.writeheader()
    writer.writerows({**r, **{k: (r["params"] or {}).get(k) for k in keys}} for r in public)
    outputs.write_atomic(sweep_dir / "sweep_summary.csv", text.getvalue().encode())  # a reader never sees half a table


def _loss(row: dict[str, Any]) -> str:
    """A completed job's final loss; for one that ended early, the last loss it logged and that step's number."""
    if row.get("last_logged_loss") is None:
        return _num(row["final_loss"])
    return f"last logged {outputs.loss_at(row['last_logged_loss'], row['last_logged_step'])}"


def _num(value: Any, fmt: str = ".6g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)
