"""What each picture of ``dlaunch report`` shows, read from the matplotlib figure: titles, lines, styles, bars."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from launcher.cli.report import jobs, plots  # noqa: E402
from launcher.runtime import outputs  # noqa: E402
from tests.cli.report.runs import assert_real_png, write_run  # noqa: E402


def loaded(*paths: Path) -> list[jobs.Job]:
    found = [jobs.load(p, p.name) for p in paths]
    jobs.label(found)
    return found


def integer_steps(ax) -> bool:
    locator = ax.xaxis.get_major_locator()
    return isinstance(locator, MaxNLocator) and locator._integer


def test_a_runs_loss_names_its_recipe_strategy_and_cluster(tmp_path):
    write_run(tmp_path / "2026-01-02_10-00-00", lr=0.05, where=("digits", "multi_worker_mirrored", "2x2"))
    (job,) = loaded(tmp_path / "2026-01-02_10-00-00")

    fig = plots.run_loss(job)

    (ax,) = fig.axes
    assert ax.get_title() == "loss: digits · multi_worker_mirrored · 2x2\n2026-01-02_10-00-00"
    assert len(ax.lines) == 1 and ax.get_yscale() == "log" and integer_steps(ax)
    assert_real_png(plots.save(fig, tmp_path / "loss.png"))


def test_a_run_that_logged_one_step_gets_whole_steps_on_x(tmp_path):
    write_run(tmp_path / "run", lr=0.05, steps=1, extra=True)
    (job,) = loaded(tmp_path / "run")
    for fig in (plots.run_loss(job), plots.run_metrics(job)):
        for ax in fig.axes:
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(t == int(t) for t in ticks) and 1 in ticks, ticks


def test_a_killed_run_is_named_from_its_config_and_drawn_dashed(tmp_path):
    write_run(tmp_path / "run", lr=0.05, status=None, where=("linear", "one_device", "1x1"))
    write_run(tmp_path / "failed", lr=0.05, status="failed", where=("linear", "mirrored", "1x2"))
    killed, failed = loaded(tmp_path / "run", tmp_path / "failed")

    assert plots.run_loss(killed).axes[0].get_title().startswith("loss: linear · one_device · 1x1\n")
    ax = plots.run_loss(failed).axes[0]
    assert ax.get_title().startswith("loss: linear · mirrored · 1x2 (failed)")
    assert ax.lines[0].get_linestyle() == "--"


def test_a_runs_evaluation_loss_and_its_resumes_are_on_the_loss_chart(tmp_path):
    """Train and evaluation loss on one pair of axes (where they part, the model overfits), and a dotted line at
    each step a command resumed from: the curve is joined there, and a user should see where."""
    import json

    write_run(tmp_path / "run", lr=0.05)
    evaluations = [{"step": s, "eval_loss": 2.0 / s, "eval_accuracy": 0.5} for s in (50, 100, 200)]
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in evaluations)
    history = tmp_path / "run" / outputs.STATE_DIR / outputs.HISTORY
    history.parent.mkdir()
    history.write_text("".join(json.dumps(e) + "\n" for e in (
        {"event": "command"}, {"event": "start", "restart": 0, "resumed_from_step": 0},
        {"event": "command"}, {"event": "start", "restart": 0, "resumed_from_step": 120})))
    (job,) = loaded(tmp_path / "run")

    (ax,) = plots.run_loss(job).axes

    assert [line.get_label() for line in ax.lines] == ["train loss", "eval loss", "resumed"]
    assert list(ax.lines[1].get_xdata()) == [50, 100, 200] and list(ax.lines[2].get_xdata()) == [120, 120]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train loss", "eval loss", "resumed"]
    assert_real_png(plots.save(plots.run_metrics(job), tmp_path / "metrics.png"))  # eval_accuracy is there


def test_a_runs_metrics_draw_lr_and_grad_norm(tmp_path):
    write_run(tmp_path / "run", lr=0.05, extra=True)
    (job,) = loaded(tmp_path / "run")

    fig = plots.run_metrics(job)

    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == ["grad_norm", "lr"]
    assert all(len(ax.lines) == 1 and integer_steps(ax) for ax in shown)
    assert shown[1].lines[0].get_ydata()[0] == pytest.approx(0.05 * (1 - 1 / 400))

    write_run(tmp_path / "plain", lr=0.05)
    assert plots.run_metrics(loaded(tmp_path / "plain")[0]) is None


def test_a_runs_lr_schedule_is_drawn_on_a_linear_axis_and_a_falling_grad_norm_on_a_log_one(tmp_path):
    """A warmup and a cosine decay towards 0 spans over 20x: the lr chart went to a log axis, which bends the schedule's
    shape (and went linear again for a decay that reached 0)."""
    import json
    import math

    write_run(tmp_path / "run", lr=0.05)
    records = [{"step": s, "loss": 1.0, "lr": 0.1 * min(s / 10, 0.5 * (1 + math.cos(math.pi * s / 101))),
                "grad_norm": 100.0 / s} for s in range(1, 101)]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    shown = {ax.get_title(): ax for ax in plots.run_metrics(loaded(tmp_path / "run")[0]).axes if ax.get_visible()}
    assert shown["lr"].get_yscale() == "linear" and shown["grad_norm"].get_yscale() == "log"


@pytest.fixture
def four_jobs(tmp_path) -> list[jobs.Job]:
    """Jobs 0 and 1 train identically (a strategy sweep does: the same numbers); job 3 failed part way."""
    write_run(tmp_path / "0", lr=0.05, overrides=["strategy=one_device", "trainer.steps=200"], extra=True)
    write_run(tmp_path / "1", lr=0.05, overrides=["strategy=mirrored", "trainer.steps=200"], extra=True)
    write_run(tmp_path / "2", lr=0.02, overrides=["strategy=central_storage", "trainer.steps=200"], extra=True)
    write_run(tmp_path / "3", lr=0.05, steps=60, status="failed", error="ValueError: boom",
              overrides=["strategy=multi_worker_mirrored", "trainer.steps=200"])
    return loaded(*(tmp_path / n for n in "0123"))


def test_identical_curves_stay_visible_and_a_failed_one_is_dashed(four_jobs):
    fig = plots.sweep_loss(four_jobs, "sweep")

    (ax,) = fig.axes
    assert ax.get_title() == "loss: sweep sweep (linear · mirrored · 1x2, 4 jobs, 1 failed)"
    assert len(ax.lines) == 4
    same_a, same_b = ax.lines[0], ax.lines[1]
    assert list(same_a.get_ydata()) == list(same_b.get_ydata())
    assert same_a.get_marker() != same_b.get_marker()  # the second curve's markers show on top of the first
    assert same_a.get_markevery() != same_b.get_markevery()  # and fall at other steps
    assert len({line.get_marker() for line in ax.lines}) == 4
    assert len({to_hex(line.get_color()) for line in ax.lines}) == 4
    assert [line.get_linestyle() for line in ax.lines] == ["-", "-", "-", "--"]
    assert len(ax.lines[3].get_xdata()) == 7  # the failed job's partial curve: steps 1, 10, ..., 60
    assert ax.get_yscale() == "log" and integer_steps(ax)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["0: strategy=one_device", "1: strategy=mirrored", "2: strategy=central_storage",
                      "3: strategy=multi_worker_mirrored (failed)"]


def test_a_stopped_job_is_counted_as_stopped_not_failed(tmp_path):
    write_run(tmp_path / "0", lr=0.05)
    write_run(tmp_path / "1", lr=0.05, steps=60, status="stopped")
    write_run(tmp_path / "2", lr=0.05, steps=40, status="failed", error="ValueError: boom")
    fig = plots.sweep_loss(loaded(*(tmp_path / n for n in "012")), "s")
    assert fig.axes[0].get_title().endswith("3 jobs, 1 failed, 1 stopped)")
    assert [line.get_linestyle() for line in fig.axes[0].lines] == ["-", "--", "--"]


def test_a_stopped_sweeps_jobs_not_started_are_counted_as_such_and_the_page_gives_the_sweeps_one_command(tmp_path):
    """A stopped sweep's report counted its jobs not started as stopped and told `dlaunch resume JOB_DIR` of each,
    where the terminal gave the sweep's one command, which also starts them."""
    from launcher.cli.report import page

    write_run(tmp_path / "0", lr=0.05)
    write_run(tmp_path / "1", lr=0.05, steps=60, status="stopped")
    write_run(tmp_path / "2", lr=0.05, steps=10, status="not started")
    jobs = loaded(*(tmp_path / n for n in "012"))
    assert plots.sweep_loss(jobs, "s").axes[0].get_title().endswith("3 jobs, 1 stopped, 1 not started)")
    html = page.failed_jobs(jobs[1:], tmp_path)
    assert f"Jobs a signal cut short (1 stopped, 1 not started): dashed in the loss chart; <code>dlaunch resume " \
           f"{tmp_path}</code> resumes each stopped job from its checkpoint (where it saved one) and starts the others" in html


def test_a_job_with_no_curve_is_counted_in_the_title(four_jobs):
    """A job refused by its config logged nothing: it has no curve, but it is one of the sweep's jobs."""
    title = plots.sweep_loss(four_jobs[:3], "s", four_jobs).axes[0].get_title()
    assert title.endswith("4 jobs, 1 failed; 3 with a loss curve)"), title


def test_one_job_is_counted_as_one(four_jobs):
    title = plots.sweep_loss(four_jobs[:1], "s").axes[0].get_title()
    assert title.endswith("(linear · mirrored · 1x2, 1 job)")


def test_a_sweeps_metrics_overlay_every_job(four_jobs):
    fig = plots.sweep_metrics(four_jobs, "sweep")

    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == ["grad_norm", "lr"]
    assert all(len(ax.lines) == 3 for ax in shown)  # the failed job logged neither
    assert fig.get_suptitle() == "logged metrics: sweep sweep (4 jobs)"


def test_every_job_tied_for_best_is_highlighted_and_values_share_one_precision(tmp_path):
    for name, accuracy in (("0", 0.9312), ("1", 0.5), ("2", 0.93124), ("3", 0.0123)):
        write_run(tmp_path / name, lr=0.1, metrics={"eval_accuracy": accuracy}, overrides=[f"seed={name}"])
    found = loaded(*(tmp_path / n for n in "0123"))
    bars = [(j, jobs.final_value(j, "eval_accuracy")) for j in found]
    spec = jobs.fixed_format([v for _, v in bars])
    best = jobs.best(bars, jobs.lower_is_better("eval_accuracy"), lambda v: format(v, spec))

    fig = plots.final_metric(bars, "eval_accuracy", "sweep", spec, best, False)

    (ax,) = fig.axes
    assert [j.name for j in best] == ["0", "2"]  # 0.9312 and 0.93124 print alike: a tie as the reader sees it
    colors = [to_hex(p.get_facecolor()) for p in ax.patches]
    assert colors == [to_hex(plots.BEST_COLOR), to_hex(plots.OTHER_COLOR)] * 2
    assert [t.get_text() for t in ax.texts] == ["0.9312", "0.5000", "0.9312", "0.0123"]
    assert ax.get_title() == "eval_accuracy per job: sweep sweep (higher is better); 2 tie for best"
    assert_real_png(plots.save(fig, tmp_path / "final_metric.png"))


@pytest.mark.parametrize(("values", "expected"), [
    ([0.5, 0.0123], ".4f"), ([12.5, 3.0], ".2f"), ([1234.0, 99.0], ".1f"), ([1e-6, 0.5], ".2e"), ([0.0], ".0f"),
])
def test_one_precision_for_a_charts_values(values, expected):
    assert jobs.fixed_format(values) == expected


def test_the_best_checkpoint_is_starred_on_the_curve_of_its_metric_and_named_on_the_page(tmp_path):
    import json

    from launcher.cli.report import page

    write_run(tmp_path / "run", lr=0.05)
    evals = [{"step": s, "eval_loss": 1.0 / s + (0.01 if s > 100 else 0)} for s in range(20, 201, 20)]
    with (tmp_path / "run" / "metrics.jsonl").open("a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in evals))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    summary["best"] = {"metric": "eval_loss", "value": 0.01, "step": 100, "checkpoint": "/r/checkpoints/step-00000100"}
    outputs.write_json_atomic(tmp_path / "run" / "summary.json", summary)
    (job,) = loaded(tmp_path / "run")
    for ax in (plots.run_loss(job).axes[0], next(a for a in plots.run_metrics(job).axes if a.get_title() == "eval_loss")):
        (star,) = [line for line in ax.lines if line.get_marker() == "*"]
        assert list(star.get_xdata()) == [100] and list(star.get_ydata()) == [0.01]
        assert "best checkpoint (step 100)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert "eval_loss=0.01 at step 100: /r/checkpoints/step-00000100" in page.run_table(job)
