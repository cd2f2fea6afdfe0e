"""A sweep's invalid combinations, said before its first job (launcher/cli/sweep_jobs.py)."""

from __future__ import annotations

from rich.console import Console

from launcher.cli import job as cli_job
from launcher.cli import main as cli
from launcher.cli.sweep_jobs import Checked, announce_invalid
from launcher.config.errors import ConfigError, Problem


def _said(checked: Checked) -> str:
    console = Console(record=True, width=300)
    announce_invalid(checked, console)
    return console.export_text()


def test_jobs_with_the_same_reason_are_one_line_with_their_count_and_one_of_them():
    same = ConfigError([Problem(key="cluster", value="1x2", message="one_device runs 1 replica")])
    long = ConfigError([Problem(key="recipe.lr", value="x", message="y" * 500)])
    checked = Checked(valid={("a=1", "steps=5"): object()},
                      invalid={("a=2", "steps=5"): same, ("a=3", "steps=5"): same, ("a=4", "steps=5"): long})
    lines = _said(checked).splitlines()
    assert lines[0].startswith("these sweep jobs will not start")
    assert lines[1] == "  2 jobs, e.g. a=2: cluster=1x2: one_device runs 1 replica"  # steps=5: every job's, not shown
    assert lines[2].startswith("  a=4: recipe.lr=x: yyy") and lines[2].endswith("...") and len(lines[2]) < 220
    assert _said(Checked(valid={("a=1",): object()})) == ""  # nothing invalid: nothing said


def test_a_job_told_apart_by_its_bad_value_is_not_named_twice():
    """`-m recipe.optimizer.lr=-1,0.1` said `recipe.optimizer.lr=-1: recipe.optimizer.lr=-1: Input should be ...`."""
    bad = ConfigError([Problem(key="recipe.optimizer.lr", value=-1, message="Input should be greater than 0")])
    checked = Checked(valid={("recipe.optimizer.lr=0.1", "steps=2"): object()},
                      invalid={("recipe.optimizer.lr=-1", "steps=2"): bad})
    assert _said(checked).splitlines()[1] == "  recipe.optimizer.lr=-1: Input should be greater than 0"


def test_a_dry_run_sweep_announces_nothing_it_would_not_run(tmp_path, monkeypatch, capsys):
    """Under launch.dry_run=true no job runs: "the other jobs run, Ctrl-C stops the sweep" would be false."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)
    code = cli.main(["-m", "strategy=one_device,mirrored", "cluster=1x1,1x2", "launch.dry_run=true",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    err = capsys.readouterr().err
    assert code == 1 and "cluster = 1x2" in err, err[-2000:]  # job 1 said why it did not start, in its turn
    assert "will not start" not in err


def test_an_invalid_job_after_a_stop_does_not_say_the_other_jobs_run(tmp_path):
    """After job 0's SIGINT, job 1 (invalid) said `not started (the other jobs of the sweep run)`, and job 2 then
    `not started (job 0 was stopped by SIGINT, which stops the sweep)`."""
    from launcher.cli.sweep_jobs import skip

    bad = ConfigError([Problem(key="cluster", value="1x2", message="one_device runs 1 replica")])
    for stopped, heading in (("", "job 1: not started (the other jobs of the sweep run)"),
                             ("job 0 was stopped by SIGINT", "job 1: not started (job 0 was stopped by SIGINT, which "
                                                             "stops the sweep; its config is refused too)")):
        console = Console(record=True, width=300)
        assert skip(tmp_path / stopped.replace(" ", "-") / "1", bad, console, stopped) == 2
        assert console.export_text().splitlines()[0] == heading


def test_an_unknown_key_swept_over_several_values_is_one_line():
    """`-m trainer.stesp=1,2` listed the unknown key once per value."""
    def unknown(value):
        return ConfigError([Problem(key="trainer.stesp", value=value, message="unknown key under trainer",
                                    suggestion="trainer.steps")])

    checked = Checked(valid={}, invalid={("trainer.stesp=1", "lr=1"): unknown(1), ("trainer.stesp=2", "lr=1"): unknown(2)})
    lines = _said(checked).splitlines()
    assert lines[1:] == ["  2 jobs, e.g. trainer.stesp=1: unknown key under trainer (did you mean trainer.steps?)"], lines


def test_a_typo_swept_over_two_values_is_one_problem_with_both_values():
    """`-m trainer.stpes=10,20` said the same unknown key twice ("2 problems")."""
    from launcher.cli.sweep_jobs import check

    checked = check({("trainer.stpes=10",): ["trainer.stpes=10", "cluster.device=cpu"],
                     ("trainer.stpes=20",): ["trainer.stpes=20", "cluster.device=cpu"]}, cuda=0, multirun=True)
    assert [(p.key, p.value, p.suggestion) for p in checked.up_front] == [("trainer.stpes", "10,20", "trainer.steps")]


def test_a_bad_value_the_sweep_skips_says_what_was_meant():
    """The up-front line and the table's reason said `trainer.precision=bf16: not an allowed value`, and no more."""
    from launcher.cli.sweep_jobs import reason

    meant = Problem(key="trainer.precision", value="bf16", message="not an allowed value", suggestion="bf16-mixed",
                    allowed=("fp32", "bf16-mixed", "fp16-mixed"))
    assert reason([meant]) == "trainer.precision=bf16: not an allowed value (did you mean bf16-mixed?)"
    short = Problem(key="trainer.resume", value=None, message="not an allowed value", allowed=("auto", "never"))
    assert reason([short]) == "trainer.resume=null: not an allowed value (allowed: auto, never)"
