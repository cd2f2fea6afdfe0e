"""``dlaunch report RUN_OR_SWEEP_DIR``: PNG charts and a self-contained ``report.html``, written beside the data.

A run directory gets ``loss.png`` (loss vs step) and, when ``metrics.jsonl`` records carry numeric keys
beyond step/loss/examples_per_sec/time, ``metrics.png`` with those curves; the end-of-run metrics in
``summary.json`` go in the page's table. A sweep directory (``dlaunch -m``: job directories ``0/``, ``1/``, ...)
gets ``loss.png`` with every completed job's curve overlaid and ``final_metric.png``, a bar per completed job
of the recipe's first metric (``final_loss`` when no job has one). Failed jobs are listed in the page only.

Exit codes: 0 written (the paths are printed), 1 the files could not be written, 2 nothing to report on.
matplotlib is imported only when a chart is drawn, so ``dlaunch`` itself starts without it.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import numbers
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.runtime import outputs

REPORT = "report.html"
LOSS_PNG = "loss.png"
METRICS_PNG = "metrics.png"
FINAL_METRIC_PNG = "final_metric.png"
STANDARD_KEYS = ("step", "loss", "examples_per_sec", "time")  # what every metrics.jsonl record carries
MAX_TABLE_ROWS = 1000  # the run page's per-step table; the charts always show every record
MAX_LEGEND = 20  # a sweep's loss chart labels this many curves at most
LOWER_IS_BETTER = ("loss", "error", "err", "mse", "mae", "rmse", "perplexity", "ppl")
HIGHER_IS_BETTER = ("acc", "accuracy", "auc", "f1", "precision", "recall", "ap", "map", "score")


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

    @property
    def status(self) -> str:
        if self.summary is None:
            return "no summary.json"
        return str(self.summary.get("status") or "unknown")

    @property
    def completed(self) -> bool:
        return self.summary is not None and self.summary.get("status") == "completed"

    @property
    def metrics(self) -> dict[str, Any]:
        found = (self.summary or {}).get("metrics")
        return found if isinstance(found, dict) else {}

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


@dataclass
class Written:
    paths: list[Path] = field(default_factory=list)
    images: list[tuple[str, Path]] = field(default_factory=list)  # (caption, png)

    def add(self, caption: str, path: Path) -> None:
        self.paths.append(path)
        self.images.append((caption, path))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dlaunch report",
        description="Chart a run or sweep directory: PNGs and a self-contained report.html, written beside the data.",
    )
    parser.add_argument("directory", metavar="RUN_OR_SWEEP_DIR", type=Path,
                        help="a run directory (metrics.jsonl, summary.json) or a sweep directory (0/, 1/, ...)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse has already said why
        return int(exc.code or 0)
    try:
        written = report(args.directory)
    except ReportError as exc:
        print(f"dlaunch report: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"dlaunch report: error: cannot write the report in {args.directory}: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def report(directory: Path) -> list[Path]:
    """Write the charts and report.html for a run or sweep directory; return the paths written."""
    directory = Path(directory).expanduser()
    if not directory.exists():
        raise ReportError(f"{directory}: no such directory")
    if not directory.is_dir():
        raise ReportError(f"{directory} is not a directory")
    if not any(directory.iterdir()):
        raise ReportError(f"{directory} is empty: nothing to report on")
    job_dirs = _sweep_jobs(directory)
    if job_dirs:
        return _report_sweep(directory, [_load(d, d.name) for d in job_dirs])
    if (directory / outputs.METRICS).exists() or (directory / outputs.SUMMARY).exists():
        return _report_run(directory, _load(directory, directory.name))
    raise ReportError(
        f"{directory} has no metrics: no {outputs.METRICS} or {outputs.SUMMARY}, and no sweep job directories (0/, 1/, ...)"
    )


# --- reading -------------------------------------------------------------------------------------------------------


def _sweep_jobs(directory: Path) -> list[Path]:
    """A sweep's job directories, in job order: numbered ones, or (a custom hydra.sweep.subdir) any run directory."""
    if (directory / outputs.METRICS).exists() or (directory / outputs.SUMMARY).exists():
        return []  # a run directory, even if it holds numbered folders of its own
    subdirs = [d for d in directory.iterdir() if d.is_dir() and not d.name.startswith(".")]
    numbered = sorted((d for d in subdirs if d.name.isdigit()), key=lambda d: int(d.name))
    if numbered:
        return numbered
    if not (directory / "multirun.yaml").exists():
        return []
    return sorted(d for d in subdirs if any((d / n).exists() for n in (outputs.METRICS, outputs.SUMMARY, ".hydra")))


def _load(path: Path, name: str) -> Job:
    return Job(name=name, path=path, overrides=_overrides(path),
               records=[r for r in outputs.read_records(path / outputs.METRICS) if isinstance(r, dict)],
               summary=_summary(path))


def _summary(path: Path) -> dict[str, Any] | None:
    found = outputs.read_summary(path)
    return found if isinstance(found, dict) else None


def _overrides(path: Path) -> list[str]:
    import yaml

    try:
        found = yaml.safe_load((path / ".hydra" / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in found] if isinstance(found, list) else []


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _extra_keys(records: list[dict[str, Any]]) -> list[str]:
    """Numeric keys of metrics.jsonl records beyond the standard four, in first-seen order."""
    keys: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k not in STANDARD_KEYS and _number(v) is not None:
                keys.setdefault(k, None)
    return list(keys)


def _has_loss(job: Job) -> bool:
    return any(_number(r.get("loss")) is not None and _number(r.get("step")) is not None for r in job.records)


# --- a run ---------------------------------------------------------------------------------------------------------


def _report_run(directory: Path, job: Job) -> list[Path]:
    if not _has_loss(job):
        status = f" (status: {job.status})" if job.summary is not None else ""
        raise ReportError(f"{directory} has no metrics: {outputs.METRICS} is missing or holds no loss records{status}")
    plt = _pyplot()
    out = Written()

    fig, ax = plt.subplots(figsize=(8, 5))
    steps, losses = job.curve("loss")
    ax.plot(steps, losses, marker="o" if len(steps) <= 50 else None, markersize=3, label="train loss")
    _log_scale_if_wide(ax, losses)
    ax.set(xlabel="step", ylabel="loss", title=f"loss: {directory.name}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    out.add("loss vs step", _save(fig, directory / LOSS_PNG))

    extra = _extra_keys(job.records)
    if extra:
        cols = min(3, len(extra))
        rows = math.ceil(len(extra) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.5 * rows + 0.5), squeeze=False)
        for ax, key in zip(axes.flat, extra):
            xs, ys = job.curve(key)
            ax.plot(xs, ys, marker="o" if len(xs) <= 50 else None, markersize=3)
            ax.set(xlabel="step", title=key)
            ax.grid(True, alpha=0.3)
        for ax in list(axes.flat)[len(extra):]:
            ax.set_visible(False)
        fig.suptitle(f"metrics: {directory.name}")
        out.add("logged metrics vs step", _save(fig, directory / METRICS_PNG))
    else:
        (directory / METRICS_PNG).unlink(missing_ok=True)  # a chart of an earlier report would be stale

    body = [_images_html(out.images), "<h2>Summary</h2>", _run_table(job)]
    if job.records:
        body += ["<h2>Logged steps</h2>", _records_table(job.records)]
    out.paths.append(_write_html(directory, f"dlaunch report: {directory.name}", body))
    return out.paths


def _run_table(job: Job) -> str:
    s = job.summary or {}
    rows: list[tuple[str, Any]] = [("status", job.status)]
    if job.overrides:
        rows.append(("overrides", " ".join(job.overrides)))
    for key in ("recipe", "strategy", "cluster", "device", "steps", "global_batch_size", "first_loss", "final_loss",
                "examples_per_sec", "wall_seconds", "restarts", "resumed_from_step"):
        if key in s:
            rows.append((key, s[key]))
    rows += [(f"metrics.{k}", v) for k, v in job.metrics.items()]
    if not job.metrics:
        rows.append(("metrics", "none recorded" if job.summary is not None else "no summary.json"))
    return _table(["", "value"], [[k, v] for k, v in rows])


def _records_table(records: list[dict[str, Any]]) -> str:
    keys = [k for k in ("step", "loss", "examples_per_sec") if any(k in r for r in records)] + _extra_keys(records)
    shown = records[:MAX_TABLE_ROWS]
    table = _table(keys, [[r.get(k) for k in keys] for r in shown])
    note = f"<p>first {MAX_TABLE_ROWS} of {len(records)} records</p>" if len(records) > len(shown) else ""
    return f"<details><summary>{len(records)} records</summary>{note}{table}</details>"


# --- a sweep -------------------------------------------------------------------------------------------------------


def _report_sweep(directory: Path, jobs: list[Job]) -> list[Path]:
    _label(jobs)
    done = [j for j in jobs if j.completed]
    failed = [j for j in jobs if not j.completed]
    if not done:
        raise ReportError(f"{directory} has no metrics: none of its {len(jobs)} job(s) completed "
                          f"({', '.join(f'{j.name}: {j.status}' for j in jobs[:5])}{', ...' if len(jobs) > 5 else ''})")
    metric = next((k for j in done for k in j.metrics), None) or "final_loss"
    bars = [(j, _final_value(j, metric)) for j in done]
    bars = [(j, v) for j, v in bars if v is not None and math.isfinite(v)]
    curves = [j for j in done if _has_loss(j)]
    if not curves and not bars:
        raise ReportError(f"{directory} has no metrics: its completed jobs logged no loss and no {metric}")

    plt = _pyplot()
    out = Written()
    if curves:
        fig, ax = plt.subplots(figsize=(9, 5.5))
        colors = _colors(plt, len(curves))
        losses: list[float] = []
        for i, (job, color) in enumerate(zip(curves, colors)):
            steps, values = job.curve("loss")
            losses += values
            ax.plot(steps, values, color=color, linewidth=1.5, label=job.label if i < MAX_LEGEND else None)
        _log_scale_if_wide(ax, losses)
        ax.set(xlabel="step", ylabel="loss", title=f"loss: {directory.name} ({len(curves)} jobs)")
        ax.grid(True, alpha=0.3)
        more = f" (+{len(curves) - MAX_LEGEND} more)" if len(curves) > MAX_LEGEND else ""
        ax.legend(fontsize="small", title=f"job: overrides{more}", title_fontsize="small",
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        out.add("loss vs step, every completed job", _save(fig, directory / LOSS_PNG))
    else:
        (directory / LOSS_PNG).unlink(missing_ok=True)

    best = _best(bars, metric)
    if bars:
        width = max(6.0, min(0.8 * len(bars) + 3, 24.0))
        fig, ax = plt.subplots(figsize=(width, 5.5))
        xs = range(len(bars))
        values = [v for _, v in bars]
        colors = ["tab:orange" if j is best else "tab:blue" for j, _ in bars]
        drawn = ax.bar(xs, values, color=colors)
        ax.bar_label(drawn, labels=[f"{v:.4g}" for v in values], fontsize="small", padding=2)
        labels = [j.label for j, _ in bars]
        fits = sum(len(s) for s in labels) * 7 < width * 100 * 0.8  # small font: about 7 px a character
        ax.set_xticks(list(xs), labels, fontsize="small",
                      **({} if fits else {"rotation": 30, "ha": "right", "rotation_mode": "anchor"}))
        direction = {True: " (lower is better)", False: " (higher is better)"}.get(_lower_is_better(metric), "")
        ax.set(ylabel=metric, title=f"{metric} per job: {directory.name}{direction}")
        ax.grid(True, axis="y", alpha=0.3)
        if min(values) > 0:
            ax.set_ylim(0, max(values) * 1.12)
        out.add(f"{metric} per completed job", _save(fig, directory / FINAL_METRIC_PNG))
    else:
        (directory / FINAL_METRIC_PNG).unlink(missing_ok=True)

    body = [_images_html(out.images), "<h2>Jobs</h2>", _sweep_table(jobs, metric, best)]
    if failed:
        items = "".join(f"<li><b>job {_e(j.name)}</b>: {_e(j.status)}"
                        f"{' &mdash; ' + _e(' '.join(j.overrides)) if j.overrides else ''}</li>" for j in failed)
        body += [f"<h2 class='failed'>Failed jobs ({len(failed)}), left out of the charts</h2><ul>{items}</ul>"]
    out.paths.append(_write_html(directory, f"dlaunch report: sweep {directory.name}", body))
    return out.paths


def _label(jobs: list[Job]) -> None:
    """Label each job by the overrides that differ across the sweep (all of them when none differ)."""
    common = set.intersection(*(set(j.overrides) for j in jobs)) if jobs else set()
    for j in jobs:
        own = [o for o in j.overrides if o not in common] or j.overrides
        j.label = f"{j.name}: {' '.join(own)}" if own else f"job {j.name}"


def _final_value(job: Job, metric: str) -> float | None:
    if metric == "final_loss":
        return _number((job.summary or {}).get("final_loss"))
    return _number(job.metrics.get(metric))


def _lower_is_better(metric: str) -> bool | None:
    words = metric.lower().replace("-", "_").split("_")
    if any(w in LOWER_IS_BETTER for w in words):
        return True
    if any(w in HIGHER_IS_BETTER for w in words):
        return False
    return None


def _best(bars: list[tuple[Job, float]], metric: str) -> Job | None:
    lower = _lower_is_better(metric)
    if lower is None or len(bars) < 2:
        return None
    return (min if lower else max)(bars, key=lambda b: b[1])[0]


def _sweep_table(jobs: list[Job], metric: str, best: Job | None) -> str:
    metric_keys = list(dict.fromkeys(k for j in jobs for k in j.metrics))
    header = ["job", "overrides", "status", "first_loss", "final_loss", *metric_keys, "examples_per_sec",
              "wall_seconds"]
    rows = []
    for j in jobs:
        s = j.summary or {}
        name = f"{_e(j.name)} &#9733;" if j is best else _e(j.name)  # the star marks the best bar of the chart
        row = [_Raw(name), " ".join(j.overrides) or "(none)", _Raw(_status_html(j))]
        row += [s.get("first_loss"), s.get("final_loss"), *(j.metrics.get(k) for k in metric_keys),
                s.get("examples_per_sec"), s.get("wall_seconds")]
        rows.append(row)
    note = f"<p>Charted metric: <b>{_e(metric)}</b>{'; &#9733; marks the best job' if best else ''}.</p>"
    return note + _table(header, rows)


def _status_html(job: Job) -> str:
    cls = "ok" if job.completed else "failed"
    text = job.status if job.completed else f"failed ({job.status})"
    return f"<span class='{cls}'>{_e(text)}</span>"


# --- drawing and writing -------------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display; before pyplot is imported
    import matplotlib.pyplot as plt

    return plt


def _colors(plt: Any, n: int) -> list[Any]:
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20" if n <= 20 else "viridis")
    return [cmap(i % 20) if n <= 20 else cmap(i / max(n - 1, 1)) for i in range(n)]


def _log_scale_if_wide(ax: Any, values: list[float]) -> None:
    """A loss that falls by orders of magnitude reads better on a log axis."""
    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 100:
        ax.set_yscale("log")


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def _images_html(images: list[tuple[str, Path]]) -> str:
    parts = []
    for caption, path in images:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(f"<figure><img alt='{_e(caption)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{_e(caption)} ({_e(path.name)})</figcaption></figure>")
    return "\n".join(parts)


class _Raw(str):
    """Table cell text that is already HTML."""


def _cell(value: Any) -> str:
    if isinstance(value, _Raw):
        return str(value)
    if value is None:
        return "&mdash;"
    if isinstance(value, float):
        return _e(f"{value:.6g}")
    if isinstance(value, (dict, list)):
        return _e(json.dumps(value))
    return _e(str(value))


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
th { background: #f3f3f3; }
td { font-variant-numeric: tabular-nums; }
figure { display: inline-block; margin: 0 1em 1em 0; }
img { max-width: 100%; border: 1px solid #ddd; }
.ok { color: #1a7f37; } .failed { color: #c62828; }
"""


def _write_html(directory: Path, title: str, body: list[str]) -> Path:
    page = (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
            f"<style>{_STYLE}</style></head>\n<body><h1>{_e(title)}</h1>\n<p>{_e(str(directory.resolve()))}</p>\n"
            + "\n".join(body) + "\n</body></html>\n")
    path = directory / REPORT
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path


def _e(text: str) -> str:
    return html.escape(text, quote=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
