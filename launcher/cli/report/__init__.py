"""``dlaunch report RUN_OR_SWEEP_DIR``: PNG charts and a self-contained ``report.html``, written beside the data.

A run directory gets ``loss.png`` (loss vs step, titled with the recipe, strategy and cluster) and, when
``metrics.jsonl`` records carry numeric keys beyond step/loss/examples_per_sec/time (lr, grad_norm, eval_*),
``metrics.png`` with those curves. A sweep directory (``dlaunch -m``: job directories ``0/``, ``1/``, ...) gets
``loss.png`` with every job's curve (its own colour and markers; a failed job's partial curve dashed),
``metrics.png`` with the other logged keys overlaid the same way, and ``final_metric.png``, a bar per completed job
of ``sweep.objective`` where the sweep gave one, else of the first metric the recipe's ``evaluate`` returned
(``final_loss`` when no job has one), every job tied for best highlighted. The page
shows a failed run's root cause: the block the terminal showed, kept in the run's ``error.txt``.
See docs/REPORTS.md.

Exit codes: 0 written (the paths are printed), 1 the files could not be written, 2 nothing to report on.
matplotlib is imported only when a chart is drawn, so ``dlaunch`` itself starts without it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from launcher.cli.report import page
from launcher.cli.report.jobs import (Job, ReportError, best, final_value, fixed_format, is_run, label, load, lower_is_better,
                                      study_direction, sweep_jobs)
from launcher.runtime import outputs

__all__ = ["Job", "ReportError", "main", "report"]

LOSS_PNG = "loss.png"
METRICS_PNG = "metrics.png"
FINAL_METRIC_PNG = "final_metric.png"


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
    job_dirs = sweep_jobs(directory)
    if job_dirs:
        return report_sweep(directory, [load(d, d.name) for d in job_dirs])
    if is_run(directory):  # a sweep's job is named with its sweep: its own name is a number
        in_sweep = (directory.resolve().parent / "multirun.yaml").is_file()
        return report_run(directory, load(directory, f"{directory.resolve().parent.name}/{directory.name}"
                                          if in_sweep else directory.name))
    raise ReportError(
        f"{directory} has no metrics: no {outputs.METRICS} or {outputs.SUMMARY}, and no sweep job directories (0/, 1/, ...)"
    )


class _Charts:
    """The PNGs of one report: drawn ones saved and listed for the page, absent ones' stale files removed."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.paths: list[Path] = []
        self.images: list[tuple[str, Path]] = []

    def put(self, name: str, caption: str, fig: object | None) -> None:
        from launcher.cli.report import plots

        path = self.directory / name
        if fig is None:
            path.unlink(missing_ok=True)  # a chart of an earlier report would be stale
            return
        self.paths.append(plots.save(fig, path))
        self.images.append((caption, path))


def report_run(directory: Path, job: Job) -> list[Path]:
    from launcher.cli.report import plots

    if not job.has_loss and not job.exception and not job.script:
        status = f" (status: {job.status})" if job.summary is not None else ""
        raise ReportError(f"{directory} has no metrics: {outputs.METRICS} is missing or holds no loss records{status}")
    charts = _Charts(directory)
    charts.put(LOSS_PNG, "loss vs step", plots.run_loss(job) if job.has_loss else None)
    charts.put(METRICS_PNG, "logged metrics vs step", plots.run_metrics(job))
    body = [page.images(charts.images)]
    if job.exception:
        body += ["<h2 class='failed'>Root cause</h2>", page.root_cause(job)]
    body += ["<h2>Summary</h2>", page.run_table(job)]
    if job.records:
        body += ["<h2>Logged steps</h2>", page.records_table(job.records)]
    typed = " ".join(job.overrides)
    typed = typed if len(typed) <= 100 else typed[:97] + "..."
    return [*charts.paths, page.write(directory, f"dlaunch report: {job.name}" + (f" ({typed})" if typed else ""), body)]


def report_sweep(directory: Path, jobs: list[Job]) -> list[Path]:
    from launcher.cli.report import plots

    label(jobs)
    done = [j for j in jobs if j.completed]
    if not done and not any(j.has_loss for j in jobs):  # stopped or failed jobs' curves (every job diverged): a page
        raise ReportError(f"{directory} has no metrics: none of its {len(jobs)} job(s) completed or logged a loss "
                          f"({', '.join(f'{j.name}: {j.status}' for j in jobs[:5])}{', ...' if len(jobs) > 5 else ''})")
    metric = next((m for j in done if (m := outputs.ranking_metric(j.path, j.summary))), None) or outputs.DEFAULT_OBJECTIVE
    bars = [(j, final_value(j, metric)) for j in done]
    bars = [(j, v) for j, v in bars if v is not None and math.isfinite(v)]
    curves = [j for j in jobs if j.has_loss]
    if not curves and not bars and not any(j.script for j in done):
        raise ReportError(f"{directory} has no metrics: its completed jobs logged no loss and no {metric}")

    charts = _Charts(directory)
    charts.put(LOSS_PNG, "loss vs step, every job (failed and stopped ones dashed)",
               plots.sweep_loss(curves, directory.name, jobs) if curves else None)
    charts.put(METRICS_PNG, "logged metrics vs step, every job", plots.sweep_metrics(curves, directory.name))
    spec = fixed_format([v for _, v in bars])
    lower = lower_is_better(metric, study_direction(directory, metric))
    tops = best(bars, lower, lambda v: format(v, spec))
    charts.put(FINAL_METRIC_PNG, f"{metric} per completed job",
               plots.final_metric(bars, metric, directory.name, spec, tops, lower) if bars else None)
    body = [page.images(charts.images), "<h2>Jobs</h2>", page.sweep_table(jobs, metric, tops),
            page.failed_jobs([j for j in jobs if not j.completed], directory)]
    return [*charts.paths, page.write(directory, f"dlaunch report: sweep {directory.name}", body)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
