"""``dlaunch report``: charts and report.html for a run or a sweep directory, built here from hand-written files."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from launcher.cli import report  # noqa: E402
from tests.cli.report.runs import assert_real_png, write_run  # noqa: E402


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    write_run(root / "0", lr=0.05, metrics={"eval_accuracy": 0.81, "eval_loss": 0.42})
    write_run(root / "1", lr=0.02, metrics={"eval_accuracy": 0.93, "eval_loss": 0.21})
    write_run(root / "2", lr=0.5, status="failed", metrics={"eval_accuracy": 0.11, "eval_loss": 9.0})
    write_run(root / "3", lr=0.9, status=None)  # killed: metrics.jsonl but no summary.json
    write_run(root / "10", lr=0.01, metrics={"eval_accuracy": 0.88, "eval_loss": 0.3})
    (root / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    return root


def test_run_directory_gets_loss_metrics_and_a_self_contained_page(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, lr=0.03, metrics={"eval_loss": 0.25, "eval_auc": 0.97}, extra=True)

    assert report.main([str(run)]) == 0

    printed = capsys.readouterr().out.split()
    for name in ("loss.png", "metrics.png", "report.html"):
        assert str(run / name) in printed
        assert (run / name).exists()
    assert_real_png(run / "loss.png")
    assert_real_png(run / "metrics.png")  # the grad_norm and lr curves
    page = (run / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2
    assert "src='loss.png'" not in page and 'src="loss.png"' not in page  # embedded, not linked: the page can move
    for expected in ("eval_loss", "0.25", "eval_auc", "0.97", "completed", "recipe.optimizer.lr=0.03"):
        assert expected in page, expected


def test_run_directory_without_extra_curves_draws_only_the_loss(tmp_path):
    run = tmp_path / "run"
    write_run(run, lr=0.03, metrics={"eval_loss": 0.25})
    (run / "metrics.png").write_bytes(b"stale chart of an earlier report")

    assert report.main([str(run)]) == 0

    assert_real_png(run / "loss.png")
    assert not (run / "metrics.png").exists()
    assert "eval_loss" in (run / "report.html").read_text()


def test_sweep_overlays_curves_and_charts_the_first_metric(sweep, capsys):
    assert report.main([str(sweep)]) == 0

    printed = capsys.readouterr().out.split()
    for name in ("loss.png", "final_metric.png", "report.html"):
        assert str(sweep / name) in printed
    assert_real_png(sweep / "loss.png")
    assert_real_png(sweep / "final_metric.png")
    page = (sweep / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2
    for overrides in ("recipe.optimizer.lr=0.05", "recipe.optimizer.lr=0.02", "recipe.optimizer.lr=0.01",
                      "recipe.optimizer.lr=0.5", "recipe.optimizer.lr=0.9", "trainer.steps=200"):
        assert overrides in page, overrides
    assert "Charted metric: <b>eval_accuracy</b>" in page  # the first metric the recipe's evaluate returned
    failed = page.split("Failed jobs", 1)[1]
    assert "job 2" in failed and "failed" in failed
    assert "job 3" in failed and "no summary.json: killed (SIGKILL, out of memory) or still running" in failed
    assert "job 0" not in failed and "job 1<" not in failed and "job 10" not in failed


@pytest.mark.parametrize("objective, overrides, charted", [
    ("final_loss", [], "eval_loss"),  # sweep.objective left alone: the first metric in evaluate's order, not alphabetical
    ("eval_accuracy", [], "eval_accuracy"),
    ("final_loss", ["sweep.objective=final_loss"], "final_loss"),  # the default, given on purpose
])
def test_a_sweep_is_ranked_by_its_objective_else_by_the_first_metric_evaluate_returned(tmp_path, objective, overrides, charted):
    root = tmp_path / "sweep"
    for job, (lr, loss, accuracy) in enumerate([(0.05, 0.42, 0.93), (0.02, 0.21, 0.81)]):
        write_run(root / str(job), lr=lr, metrics={"eval_loss": loss, "eval_accuracy": accuracy}, objective=objective,
                  overrides=[f"recipe.optimizer.lr={lr}", *overrides])

    assert report.main([str(root)]) == 0

    page = (root / "report.html").read_text()
    assert f"Charted metric: <b>{charted}</b>" in page
    assert list(json.loads((root / "0" / "summary.json").read_text())["metrics"]) == ["eval_loss", "eval_accuracy"]


def test_sweep_without_metrics_charts_final_loss(tmp_path):
    root = tmp_path / "sweep"
    write_run(root / "0", lr=0.05)
    write_run(root / "1", lr=0.02)

    assert report.main([str(root)]) == 0

    assert_real_png(root / "final_metric.png")
    assert "Charted metric: <b>final_loss</b>" in (root / "report.html").read_text()


def test_the_real_dlaunch_files_are_read(tmp_path):
    """A sweep as `dlaunch -m` writes it: summary keys sorted, NaN written as null."""
    root = tmp_path / "sweep"
    write_run(root / "0", lr=0.05, metrics={"eval_loss": None})
    write_run(root / "1", lr=0.02, metrics={"eval_loss": 0.3})
    with (root / "0" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 210, "loss": null, "examples_per_sec": 1.0, "time": 1.0}\n{"step": 22')  # torn last line

    assert report.main([str(root)]) == 0
    assert_real_png(root / "loss.png")
    assert_real_png(root / "final_metric.png")


@pytest.mark.parametrize("case", ["missing", "empty", "file", "no_metrics", "empty_metrics", "all_failed"])
def test_nothing_to_report_is_a_one_line_error(tmp_path, capsys, case):
    target = tmp_path / "target"
    if case == "empty":
        target.mkdir()
    elif case == "file":
        target.write_text("not a directory")
    elif case == "no_metrics":
        target.mkdir()
        (target / "config.yaml").write_text("trainer: {}\n")
    elif case == "empty_metrics":
        target.mkdir()
        (target / "metrics.jsonl").write_text("")
        (target / "summary.json").write_text(json.dumps({"status": "failed", "metrics": {}}))
    elif case == "all_failed":  # failed before any loss was logged (refused by its config): nothing to draw
        for job in ("0", "1"):
            (target / job).mkdir(parents=True)
            (target / job / "summary.json").write_text(json.dumps({"status": "config error", "error": {"exception": "x"}}))

    assert report.main([str(target)]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlaunch report: error: ") and str(target) in lines[0], err
    if target.is_dir():
        assert not (target / "report.html").exists() and not (target / "loss.png").exists()


def test_usage_errors_exit_2(capsys):
    assert report.main([]) == 2
    assert "RUN_OR_SWEEP_DIR" in capsys.readouterr().err
    assert report.main(["--help"]) == 0


def test_importing_the_command_does_not_import_matplotlib():
    import subprocess
    import sys

    code = "import sys, launcher.cli.report; print('matplotlib' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_an_evaluation_record_is_not_a_gap_in_the_training_curves(tmp_path):
    """metrics.jsonl mixes step records (loss, lr, grad_norm) with evaluation records (eval_loss): each curve
    is drawn through the records that have its key."""
    records = [{"step": 1, "loss": 2.0, "lr": 0.1}, {"step": 10, "eval_loss": 1.5}, {"step": 20, "loss": 1.0, "lr": 0.05}]
    job = report.Job(name="run", path=tmp_path, overrides=[], records=records, summary=None)
    assert job.curve("lr") == ([1, 20], [0.1, 0.05])
    assert job.curve("eval_loss") == ([10], [1.5])


def test_a_sweep_whose_every_job_failed_gets_its_partial_curves_and_failed_jobs(tmp_path):
    """Every job diverged: the page a user wants most. It was refused: `none of its 2 job(s) completed or was stopped`."""
    root = tmp_path / "sweep"
    write_run(root / "0", lr=0.1, steps=30, status="failed", error="LossNotFinite: the loss is nan at step 30")
    write_run(root / "1", lr=0.2, status=None)  # killed: no summary.json

    assert report.main([str(root)]) == 0

    assert_real_png(root / "loss.png")
    page = (root / "report.html").read_text()
    assert "Failed jobs" in page and "LossNotFinite: the loss is nan at step 30" in page
    assert "last logged" in page and not (root / "final_metric.png").exists()


def test_a_failed_jobs_exception_is_on_the_page(tmp_path):
    root = tmp_path / "sweep"
    write_run(root / "0", lr=0.05)
    write_run(root / "1", lr=0.5, steps=40, status="failed", error="ValueError: boom at step 40")

    assert report.main([str(root)]) == 0

    page = (root / "report.html").read_text()
    jobs_table, failed = page.split("Failed jobs", 1)
    assert "failed: ValueError: boom at step 40" in jobs_table  # the status cell says why
    assert "<pre class='cause'>worker rank 1 failed: root cause\nValueError: boom at step 40" in failed  # error.txt
    assert "dashed in the loss chart" in failed


def test_a_null_grad_norm_is_a_gap_in_its_curve_and_a_dash_in_the_table(tmp_path):
    """metrics.jsonl writes an inf or NaN grad_norm (fp16-mixed's skipped steps) as null: the report still draws the
    curve, with the null step left out, and its table shows the step without a value."""
    run = tmp_path / "run"
    write_run(run, lr=0.03, steps=30, extra=True)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records[1]["grad_norm"] = None
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    assert report.main([str(run)]) == 0
    assert_real_png(run / "metrics.png")
    steps, values = report.load(run, "run").curve("grad_norm")
    assert steps == [1, 10, 20, 30] and math.isnan(values[1]) and all(math.isfinite(v) for v in values[::2])
    (row,) = re.findall(r"<tr><td>10</td>.*?</tr>", (run / "report.html").read_text())
    assert row.count("&mdash;") == 1  # the grad_norm cell


def test_a_resumed_jobs_throughput_and_time_are_marked_as_its_last_commands(sweep):
    summary_path = sweep / "1" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["resumed_from_step"] = 120
    summary_path.write_text(json.dumps(summary))

    assert report.main([str(sweep)]) == 0

    page = (sweep / "report.html").read_text()
    table = page.split("<table>", 1)[1].split("</table>", 1)[0]
    rows = {re.match(r"<td>(\d+)", row).group(1): row for row in table.split("<tr>")[2:]}  # by job (job 1: starred)
    resumed, fresh = rows["1"], rows["0"]
    assert "<td>5100*</td>" in resumed and "<td>1.5*</td>" in resumed, resumed
    assert "*" not in fresh, fresh
    assert "* resumed (job 1 from step 120): examples/s and wall_seconds cover only the steps" in page


def test_a_sweeps_report_charts_the_jobs_its_summary_lists_not_an_earlier_sweeps_left_beside_them(tmp_path):
    """A sweep of 2 jobs run again into the directory of a 3-job one: the report's title said 3 jobs, and its legend
    and table had the earlier sweep's job 2."""
    import json

    from launcher.cli.report.jobs import sweep_jobs

    for n in range(3):
        (tmp_path / str(n)).mkdir()
        (tmp_path / str(n) / "summary.json").write_text(json.dumps({"status": "completed"}))
    jobs = [{"job": n, "dir": str(tmp_path / str(n))} for n in range(2)]
    (tmp_path / "sweep_summary.json").write_text(json.dumps({"jobs": jobs}))
    assert [p.name for p in sweep_jobs(tmp_path)] == ["0", "1"]
    (tmp_path / "sweep_summary.json").unlink()  # a sweep still running, or stopped before its table: every job
    assert [p.name for p in sweep_jobs(tmp_path)] == ["0", "1", "2"]


def test_a_sweeps_job_is_named_with_its_sweep_and_its_page_with_its_overrides(sweep):
    """`dlaunch report multirun/x/1` titled its chart and page `1`, the name of every sweep's second job (the charts
    take the same name as the page)."""
    assert report.main([str(sweep / "1")]) == 0
    page = (sweep / "1" / "report.html").read_text()
    assert "<h1>dlaunch report: sweep/1 (recipe.optimizer.lr=0.02 trainer.steps=200)</h1>" in page, page[:800]


@pytest.mark.parametrize("direction, objective, starred", [
    (None, None, []), ("maximize", "reward", ["1"]), ("minimize", "reward", ["0"]),
    ("minimize", "final_loss", []),  # the study minimized another metric: it says nothing of the reward's direction
])
def test_a_sweeps_best_job_follows_its_optuna_studys_direction_as_the_sweeps_table_does(tmp_path, direction, objective,
                                                                                       starred):
    """A metric whose name tells no direction (``reward``): the sweep's table named the best job by the study's
    ``direction``, and the report's chart and page starred none."""
    root = tmp_path / "sweep"
    for job, reward in enumerate([0.4, 0.9]):
        write_run(root / str(job), lr=0.1 * (job + 1), metrics={"reward": reward}, objective="reward")
    jobs = [{"job": n, "dir": str(root / str(n))} for n in range(2)]
    (root / "sweep_summary.json").write_text(json.dumps({"jobs": jobs, "direction": direction, "objective": objective}))

    assert report.main([str(root)]) == 0

    page = (root / "report.html").read_text()
    assert re.findall(r"<td>(\d+) &#9733;", page) == starred


def test_jobs_all_tied_have_no_best(tmp_path):
    """Every job as good as the others: neither the report nor the sweep's table points at one."""
    from launcher.cli.report import jobs

    assert jobs.best([(0, 0.5), (1, 0.5)], True, str) == []
    assert jobs.best([(0, 0.5), (1, 0.5), (2, 0.7)], True, str) == [0, 1]
    assert jobs.best([(0, 0.5), (1, 0.7)], None, str) == []  # a metric with no known direction
