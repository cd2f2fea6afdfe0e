"""report.html: a self-contained page (charts embedded) with the run's or sweep's tables and root causes."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from launcher.cli.report.jobs import Job, best_said, extra_keys
from launcher.runtime import outputs

REPORT = "report.html"
MAX_TABLE_ROWS = 1000  # the run page's per-step table; the charts always show every record
RUN_KEYS = ("script", "recipe", "strategy", "cluster", "device", "steps", "global_batch_size", "first_loss", "final_loss",
            "examples_per_sec", "wall_seconds", "restarts", "resumed_from_step", "last_completed_step",
            "checkpoint")
SCRIPT_METRICS = "none recorded: a script reports its own"


class Raw(str):
    """Table cell text that is already HTML."""


def images(shown: list[tuple[str, Path]]) -> str:
    parts = []
    for caption, path in shown:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(f"<figure><img alt='{e(caption)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{e(caption)} ({e(path.name)})</figcaption></figure>")
    return "\n".join(parts)


def root_cause(job: Job) -> str:
    """A failed job's exception, then the block the terminal showed (error.txt), or the summary's traceback."""
    if job.completed or not (job.exception or job.root_cause):
        return ""
    block = job.root_cause or str(((job.summary or {}).get("error") or {}).get("traceback") or "")
    head = f"<p class='failed'><b>{e(job.exception)}</b></p>" if job.exception else ""
    return head + (f"<pre class='cause'>{e(block)}</pre>" if block else "")


def run_table(job: Job) -> str:
    s = job.summary or {}
    rows: list[tuple[str, Any]] = [("status", Raw(status_html(job)))]
    if job.overrides:
        rows.append(("overrides", " ".join(job.overrides)))
    rows += [(key, s[key]) if key != "final_loss" or job.completed else ("last logged loss", last_loss(job))
             for key in RUN_KEYS if key in s]
    rows += [(f"metrics.{k}", v) for k, v in job.metrics.items()]
    if job.best:
        rows.append(("best checkpoint", best_said(job.best)))
    if not job.metrics:
        rows.append(("metrics", SCRIPT_METRICS if job.script else
                     "none recorded" if job.summary is not None else "no summary.json"))
    return table(["", "value"], [[k, v] for k, v in rows])


def records_table(records: list[dict[str, Any]]) -> str:
    keys = [k for k in ("step", "loss", "examples_per_sec") if any(k in r for r in records)] + extra_keys(records)
    shown = records[:MAX_TABLE_ROWS]
    rows = table(keys, [[r.get(k) for k in keys] for r in shown])
    note = f"<p>first {MAX_TABLE_ROWS} of {len(records)} records</p>" if len(records) > len(shown) else ""
    return f"<details><summary>{len(records)} records</summary>{note}{rows}</details>"


def sweep_table(jobs: list[Job], metric: str, best: list[Job]) -> str:
    metric_keys = list(dict.fromkeys(k for j in jobs for k in j.metrics))
    header = ["job", "overrides", "status", "first_loss", "final_loss", *metric_keys, "examples_per_sec",
              "wall_seconds"]
    rows = []
    for j in jobs:
        s = j.summary or {}
        name = f"{e(j.name)} &#9733;" if j in best else e(j.name)  # the star marks the highlighted bars
        row = [Raw(name), " ".join(j.overrides) or "(none)", Raw(status_html(j))]
        part = Raw("*") if s.get("resumed_from_step") else None  # the last command's steps only, as the terminal says
        last = None if j.completed else last_loss(j)  # one that ended early has no final loss
        final = s.get("final_loss") if j.completed else last and f"last logged {last}"
        row += [s.get("first_loss"), final, *(j.metrics.get(k) for k in metric_keys),
                _marked(s.get("examples_per_sec"), part), _marked(s.get("wall_seconds"), part)]
        rows.append(row)
    stars = "; &#9733; marks the best job" + ("s (tied)" if len(best) > 1 else "") if best else ""
    resumed = [f"job {j.name} from step {(j.summary or {})['resumed_from_step']}" for j in jobs
               if (j.summary or {}).get("resumed_from_step")]
    note = (f"<p>* resumed ({e(', '.join(resumed))}): examples/s and wall_seconds cover only the steps its last command "
            "trained after that checkpoint, not the job as a whole.</p>") if resumed else ""
    return f"<p>Charted metric: <b>{e(metric)}</b>{stars}.</p>" + table(header, rows) + note


def last_loss(job: Job) -> Any:
    """A run that ended early has no final loss: the last one it logged, and at which step (its summary's
    ``last_logged_loss``, which may be of a step long before the failure)."""
    last = outputs.last_loss(job.path)
    return outputs.loss_at(*last) if last else None


def _marked(value: Any, mark: Raw | None) -> Any:
    """A cell's value with ``mark`` after it (a resumed job's throughput and time)."""
    return value if mark is None or value is None else Raw(cell(value) + mark)


def failed_jobs(unfinished: list[Job], sweep_dir: Path | None = None) -> str:
    """Each failed job with its overrides and root cause, then each stopped or not started one, with the command that
    goes on (a sweep's one command, which also starts the jobs not started); their partial curves are in the loss
    chart, dashed."""
    from launcher.cli.resume_lines import command

    failed = [j for j in unfinished if not j.stopped]
    stopped = [j for j in unfinished if j.stopped]
    parts = []
    if failed:
        items = "".join(f"<li><b>job {e(j.name)}</b>: {e(j.status)}"
                        f"{' &mdash; ' + e(' '.join(j.overrides)) if j.overrides else ''}{root_cause(j)}</li>"
                        for j in failed)
        parts.append(f"<h2 class='failed'>Failed jobs ({len(failed)}): dashed in the loss chart, "
                     f"no bar in the metric chart</h2><ul>{items}</ul>")
    if stopped:
        items = "".join(f"<li><b>job {e(j.name)}</b>: {status_html(j)}"
                        f"{' &mdash; ' + e(' '.join(j.overrides)) if j.overrides else ''}</li>" for j in stopped)
        waiting = sum(j.status == "not started" for j in stopped)
        counts = ", ".join(f"{n} {what}" for n, what in ((len(stopped) - waiting, "stopped"), (waiting, "not started")) if n)
        go_on = (f"<code>{e(command(sweep_dir))}</code> resumes each stopped job from its checkpoint (where it saved "
                 "one) and starts the others"
                 if sweep_dir else "<code>dlaunch resume JOB_DIR</code> goes on from a stopped job's checkpoint")
        parts.append(f"<h2 class='stopped'>Jobs a signal cut short ({counts}): dashed in the loss chart; {go_on}</h2>"
                     f"<ul>{items}</ul>")
    return "".join(parts)


def status_html(job: Job) -> str:
    if job.completed:
        return f"<span class='ok'>{e(job.status)}</span>"
    if job.stopped and job.status == "not started":
        return f"<span class='stopped'>{e(f'not started: {job.exception}')}</span>"
    if job.stopped:
        s = job.summary or {}
        saved = f"checkpoint at step {s['checkpoint_step']}" if s.get("checkpoint_step") is not None else "no checkpoint"
        text = f"stopped by {s.get('stopped_by') or 'a signal'}; {saved}"
        return f"<span class='stopped'>{e(text)}</span>"
    text = job.status if job.status == "failed" or job.summary is None else f"failed ({job.status})"
    if job.exception:
        text += f": {job.exception}"
    return f"<span class='failed'>{e(text)}</span>"


def cell(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if value is None:
        return "&mdash;"
    if isinstance(value, float):
        return e(f"{value:.6g}")
    if isinstance(value, (dict, list)):
        return e(json.dumps(value))
    return e(str(value))


def table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
th { background: #f3f3f3; }
td { font-variant-numeric: tabular-nums; }
figure { display: inline-block; margin: 0 1em 1em 0; }
img { max-width: 100%; border: 1px solid #ddd; }
pre.cause { background: #fff5f5; border: 1px solid #e0b4b4; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
.ok { color: #1a7f37; } .failed { color: #c62828; } .stopped { color: #9a6700; }
"""


def write(directory: Path, title: str, body: list[str]) -> Path:
    page = (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{e(title)}</title>"
            f"<style>{STYLE}</style></head>\n<body><h1>{e(title)}</h1>\n<p>{e(str(directory.resolve()))}</p>\n"
            + "\n".join(b for b in body if b) + "\n</body></html>\n")
    path = directory / REPORT
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path


def e(text: str) -> str:
    return html.escape(text, quote=True)
