"""The pictures of ``dlaunch report``, each built as a matplotlib ``Figure`` (no pyplot: no global state).

Each function returns the figure, so that tests can read its titles, lines and bars; ``save`` writes it.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from launcher.cli.report.jobs import Job, extra_keys
from launcher.runtime import outputs

MAX_LEGEND = 20  # a sweep's charts label this many jobs at most
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")
FAILED_STYLE = "--"  # a failed or stopped job's partial curve
BEST_COLOR = "tab:orange"
OTHER_COLOR = "tab:blue"


def run_loss(job: Job) -> Figure:
    """Loss vs step of one run, titled with its recipe, strategy and cluster; the evaluation's losses on the same
    axes, and a dotted line where a command resumed from a checkpoint."""
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    steps, losses = job.curve("loss")
    style = "-" if job.completed or job.summary is None else FAILED_STYLE
    ax.plot(steps, losses, marker="o" if len(steps) <= 50 else None, markersize=3, label="train loss", linestyle=style)
    shown = list(losses)
    for key in job.evaluation_losses():
        xs, ys = job.curve(key)
        ax.plot(xs, ys, marker="s", markersize=4, linestyle=style, label=key.replace("_", " "))
        _mark_best(ax, job, key)
        shown += ys
    for i, step in enumerate(job.resumes()):
        ax.axvline(step, color="grey", linestyle=":", linewidth=1, label="resumed" if i == 0 else None)
    _step_axis(ax, shown)
    what = job.describe()
    failed = "" if job.completed or job.summary is None else f" ({job.status})"
    ax.set(ylabel="loss", title=f"loss: {what}{failed}\n{job.name}" if what else f"loss: {job.name}{failed}")
    ax.legend()
    return fig


def run_metrics(job: Job) -> Figure | None:
    """One small chart per logged key beyond the loss (lr, grad_norm, eval_*); None when there is none."""
    keys = extra_keys(job.records)
    if not keys:
        return None
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(4.5 * cols, 3.5 * rows + 0.5), layout="constrained")  # no label over a title
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, key in zip(axes.flat, keys):
        xs, ys = job.curve(key)
        ax.plot(xs, ys, marker="o" if len(xs) <= 50 else None, markersize=3)
        _step_axis(ax, ys, log=not is_lr(key))  # a schedule's shape (warmup, decay towards 0) reads on a linear axis
        ax.set_title(key)
        if _mark_best(ax, job, key):
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.suptitle(f"metrics: {job.describe() or job.name}")
    return fig


def sweep_loss(jobs: list[Job], sweep: str, every: list[Job] | None = None) -> Figure:
    """Every job's loss curve, each with its own colour and markers; a failed job's partial curve dashed.
    ``every``: all the sweep's jobs, which the title counts (those with no curve too: a job refused by its config)."""
    fig = Figure(figsize=(9, 5.5))
    ax = fig.subplots()
    losses: list[float] = []
    for i, job in enumerate(jobs):
        steps, values = job.curve("loss")
        losses += values
        _draw(ax, job, i, len(jobs), steps, values)
    _step_axis(ax, losses)
    every = every or jobs
    failed, waiting = sum(not j.completed and not j.stopped for j in every), sum(j.status == "not started" for j in every)
    stopped = sum(j.stopped for j in every) - waiting
    count = _plural(len(every), "job") + "".join(f", {n} {what}" for n, what in
                                                 ((failed, "failed"), (stopped, "stopped"), (waiting, "not started")) if n)
    count += f"; {len(jobs)} with a loss curve" if len(jobs) < len(every) else ""
    what = " · ".join(shared(every))
    what += ", " if what else ""
    ax.set(ylabel="loss", title=f"loss: sweep {sweep} ({what}{count})")
    _legend(ax, len(jobs))
    return fig


def shared(jobs: list[Job]) -> list[str]:
    """What the title may say of every job, failed and refused ones included: the recipe, strategy or cluster all
    of them share, or how many there are (``2 strategies``). One a job does not record is left unsaid."""
    said = []
    for values, plural in zip(zip(*(j.facts() for j in jobs)), ("recipes", "strategies", "clusters")):
        known = set(values)
        if None not in known:
            said.append(known.pop() if len(known) == 1 else f"{len(known)} {plural}")
    return said


def sweep_metrics(jobs: list[Job], sweep: str) -> Figure | None:
    """lr, grad_norm and the other logged keys, every job overlaid in its loss.png style; None when none."""
    keys = list(dict.fromkeys(k for j in jobs for k in extra_keys(j.records)))
    if not keys:
        return None
    cols = min(2, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(6 * cols + 2.5, 3.8 * rows + 0.5), layout="constrained")  # no label over a title
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, key in zip(axes.flat, keys):
        drawn: list[float] = []
        for i, job in enumerate(jobs):
            steps, values = job.curve(key)
            drawn += values
            if steps:
                _draw(ax, job, i, len(jobs), steps, values)
        _step_axis(ax, drawn, log=not is_lr(key))
        ax.set_title(key)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    _legend(axes.flat[cols - 1], len(jobs))
    fig.suptitle(f"logged metrics: sweep {sweep} ({_plural(len(jobs), 'job')})")
    return fig


def final_metric(bars: list[tuple[Job, float]], metric: str, sweep: str, spec: str, best: list[Job],
                 lower: bool | None) -> Figure:
    """A bar per job of its final ``metric``, each printed as ``spec``; every job tied for best highlighted. ``lower``:
    whether a lower value is better (None: not known)."""
    width = max(6.0, min(0.8 * len(bars) + 3, 24.0))
    fig = Figure(figsize=(width, 5.5))
    ax = fig.subplots()
    xs = range(len(bars))
    values = [v for _, v in bars]
    colors = [BEST_COLOR if j in best else OTHER_COLOR for j, _ in bars]
    drawn = ax.bar(xs, values, color=colors)
    ax.bar_label(drawn, labels=[format(v, spec) for v in values], fontsize="small", padding=2)
    labels = [j.label for j, _ in bars]
    fits = sum(len(s) for s in labels) * 7 < width * 100 * 0.8  # small font: about 7 px a character
    ax.set_xticks(list(xs), labels, fontsize="small",
                  **({} if fits else {"rotation": 30, "ha": "right", "rotation_mode": "anchor"}))
    direction = {True: " (lower is better)", False: " (higher is better)"}.get(lower, "")
    tie = f"; {len(best)} tie for best" if len(best) > 1 else ""
    ax.set(ylabel=metric, title=f"{metric} per job: sweep {sweep}{direction}{tie}")
    ax.grid(True, axis="y", alpha=0.3)
    if min(values) > 0:
        ax.set_ylim(0, max(values) * 1.12)
    return fig


def save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def _mark_best(ax: Axes, job: Job, key: str) -> bool:
    """A star at the evaluation whose checkpoint trainer.checkpoint.best kept, on ``key``'s curve if it is judged by it."""
    best = job.best
    if best is None or best.get("metric") != key:
        return False
    ax.plot([best["step"]], [best["value"]], marker="*", markersize=15, color="gold", markeredgecolor="black", linestyle="none",
            label=f"best checkpoint (step {best['step']})")
    return True


def _draw(ax: Axes, job: Job, i: int, n: int, steps: list[float], values: list[float]) -> None:
    """Job ``i`` of ``n``: its colour and marker shape, markers shifted along the curve so that identical curves
    still show each job's markers."""
    every = max(1, min(len(steps), max(len(steps) // 8, n)))  # room for each job's own offset
    failed = not job.completed
    ax.plot(steps, values, color=_color(i, n), linewidth=1.5, linestyle=FAILED_STYLE if failed else "-",
            marker=MARKERS[i % len(MARKERS)], markersize=5, markevery=(i % every, every),
            label=(f"{job.label} ({job.status})" if failed else job.label) if i < MAX_LEGEND else None)


def _legend(ax: Axes, n: int) -> None:
    more = f" (+{n - MAX_LEGEND} more)" if n > MAX_LEGEND else ""
    ax.legend(fontsize="small", title=f"job: overrides{more}", title_fontsize="small",
              loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def is_lr(key: str) -> bool:
    """``lr``, or another parameter group's (``lr_group1``)."""
    return key == "lr" or outputs.is_group_lr(key)


def _step_axis(ax: Axes, values: list[float], log: bool = True) -> None:
    """Integer steps on x (one logged step gets its neighbours, not ticks at 4.68, 4.74, ...); a log y-axis for a
    curve that falls by more than 20x, as losses do (``log``: allowed)."""
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    low, high = ax.get_xlim()
    if high - low < 2:
        ax.set_xlim((low + high) / 2 - 1, (low + high) / 2 + 1)
    finite = [v for v in values if math.isfinite(v)]
    if log and finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)


def _color(i: int, n: int) -> tuple[float, ...]:
    from matplotlib import colormaps

    if n <= 20:
        return colormaps["tab10" if n <= 10 else "tab20"](i)
    return colormaps["viridis"](i / max(n - 1, 1))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
