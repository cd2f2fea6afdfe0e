"""launcher/launch/report.py: what a failed or stopped run's summary.json says, and which of the two a run was."""

from __future__ import annotations

import dataclasses
import json

from launcher.config.compose import compose_and_validate
from launcher.launch import report
from launcher.launch.failures import RootCause
from launcher.runtime import outputs


def spec():
    return compose_and_validate(["strategy=mirrored", "cluster=1x2", "cluster.device=cpu", "trainer.steps=50"], 0)


def cause(rank: int, stopped_by: str = "", exception: str = "ValueError: boom") -> RootCause:
    return RootCause(rank, "host", 100 + rank, "exit code 1", exception, "", 1.0 + rank, last_step=12, stopped_by=stopped_by)


def write_records(run_dir, *records):
    (run_dir / outputs.METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))


def read_summary(run_dir):
    return json.loads((run_dir / outputs.SUMMARY).read_text())


def test_a_failed_runs_summary_takes_its_losses_from_loss_records_when_an_evaluation_was_logged_last(tmp_path):
    write_records(tmp_path, {"step": 1, "loss": 2.5, "examples_per_sec": 10.0}, {"step": 10, "loss": 1.5, "examples_per_sec": 12.0},
                  {"step": 10, "eval_loss": 1.7})
    report.record_failure(spec(), tmp_path, cause(0))
    summary = read_summary(tmp_path)
    assert (summary["status"], summary["first_loss"], summary["last_logged_loss"], summary["examples_per_sec"]) == (
        "failed", 2.5, 1.5, 12.0)
    assert summary["final_loss"] is None  # it was 1.5, read by a script as the run's final loss
    assert summary["last_logged_loss_step"] == 10
    assert summary["last_logged_step"] == 10 and summary["last_completed_step"] == 12
    assert summary["error"]["exception"] == "ValueError: boom"
    assert "ValueError: boom" in (tmp_path / outputs.ERROR).read_text()


def test_ranks_that_all_stopped_on_a_signal_are_a_stop_with_its_exit_code_and_no_failure_summary(tmp_path, caplog):
    stopped = [cause(r, "SIGTERM", "Preempted: stopped by SIGTERM after step 12") for r in (0, 1)]
    assert report.report_failures(stopped, [], spec(), tmp_path) == 143
    assert not (tmp_path / outputs.SUMMARY).exists() and not (tmp_path / outputs.ERROR).exists()
    assert "SIGTERM reached the workers, not dlaunch" in caplog.text


def test_a_rank_that_lost_its_stopped_peer_is_part_of_the_stop_not_a_failure(tmp_path, caplog):
    """A stop inside the first step ends a rank at once; a peer already past that step fails in its next collective
    on the closed connection: the run was stopped, and that rank's error is the stop's consequence."""
    lost = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5"
    mixed = [cause(0, "SIGINT", "Preempted: stopped by SIGINT in step 1, before it completed"), cause(1, exception=lost)]
    assert report.report_failures(mixed, [], spec(), tmp_path) == 130
    assert not (tmp_path / outputs.ERROR).exists() and "SIGINT reached the workers, not dlaunch" in caplog.text


def test_a_real_failure_beside_a_stopped_rank_is_a_failure(tmp_path):
    mixed = [cause(0, "SIGTERM", "Preempted: stopped by SIGTERM after step 12"), cause(1)]
    assert report.report_failures(mixed, [], spec(), tmp_path) == 1
    assert read_summary(tmp_path)["error"]["exception"] == "ValueError: boom"


def test_a_failed_runs_last_loss_is_paired_with_its_own_step_not_a_later_evaluations(tmp_path):
    write_records(tmp_path, {"step": 20, "loss": 1.5, "examples_per_sec": 10.0}, {"step": 25, "eval_loss": 1.7})
    report.record_failure(spec(), tmp_path, cause(0))
    summary = read_summary(tmp_path)
    assert (summary["last_logged_loss"], summary["last_logged_loss_step"], summary["last_logged_step"]) == (1.5, 20, 25)


def test_a_stopped_runs_summary_names_the_signal_and_the_checkpoint(tmp_path):
    write_records(tmp_path, {"step": 1, "loss": 2.5, "examples_per_sec": 10.0})
    saved = tmp_path / "checkpoints" / "step-00000040"
    report.record_stop(spec(), tmp_path, 130, saved)
    summary = read_summary(tmp_path)
    assert {k: summary[k] for k in ("status", "stopped_by", "exit_code", "checkpoint", "checkpoint_step", "final_loss")} == {
        "status": "stopped", "stopped_by": "SIGINT", "exit_code": 130, "checkpoint": str(saved), "checkpoint_step": 40,
        "final_loss": None}
    assert (summary["last_logged_loss"], summary["last_logged_loss_step"]) == (2.5, 1)
    report.record_stop(spec(), tmp_path, 143, None)  # checkpoints off, or none complete
    assert (read_summary(tmp_path)["checkpoint"], read_summary(tmp_path)["checkpoint_step"]) == (None, None)


def test_a_run_directory_that_cannot_be_written_any_more_loses_its_end_files_with_one_line(tmp_path, monkeypatch, caplog):
    """A full disk, or a directory made read-only mid-run: the terminal showed the root cause already; writing it
    into the directory fails with one warning, no traceback, and leaves no half-written summary behind."""
    write_records(tmp_path, {"step": 1, "loss": 2.5, "examples_per_sec": 10.0})

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tmp_path), "write_text", full)
    monkeypatch.setattr(type(tmp_path), "write_bytes", full)
    report.record_failure(spec(), tmp_path, cause(0))
    report.record_stop(spec(), tmp_path, 143, None)
    assert caplog.text.count("could not write ") == 3 and "No space left on device" in caplog.text  # error.txt, summary x2
    assert sorted(p.name for p in tmp_path.iterdir()) == [outputs.METRICS]


def test_a_worker_whose_error_file_cannot_be_written_says_its_error_on_stderr(tmp_path, capsys):
    from launcher.launch import failures

    try:
        raise ValueError("the real cause")
    except ValueError as exc:
        failures.write_error_file(str(tmp_path / "no-such-dir" / "error.json"), exc, 1)
    err = capsys.readouterr().err
    assert "rank 1 could not record its error" in err and "ValueError: the real cause" in err
    assert not (tmp_path / "no-such-dir").exists()


def test_a_killed_ranks_last_completed_step_is_at_least_the_last_logged_one(tmp_path):
    """Its heartbeat, written about once a second, said step 18; every rank had taken part in step 30's loss reduce."""
    killed = RootCause(1, "host", 101, "signal SIGKILL", "", "", 1.0)
    outputs.progress_file(tmp_path, 1).parent.mkdir(parents=True)
    outputs.progress_file(tmp_path, 1).write_text(json.dumps({"step": 18}))
    assert report.with_last_step(killed, tmp_path).last_step == 18
    assert report.with_last_step(killed, tmp_path, floor=30).last_step == 30
    assert report.with_last_step(cause(0), tmp_path, floor=10).last_step == 12  # what the rank said itself stands
    said = dataclasses.replace(cause(0), last_step=2)  # its step 3 diverged: logged (loss null), not completed
    assert report.with_last_step(said, tmp_path, floor=3).last_step == 2
    assert report.with_last_step(RootCause(2, "host", 102, "signal SIGKILL", "", "", 1.0), tmp_path, floor=30).last_step == 30


def test_the_last_logged_step_skips_records_without_one(tmp_path):
    """A script may write a metrics.jsonl of its own: records of any shape, never a crash while reporting."""
    write_records(tmp_path, {"step": 10, "loss": 1.0}, {"epoch": 2, "acc": 0.9}, {"step": "last"})
    assert report.last_logged_step(tmp_path) == 10
    write_records(tmp_path, {"epoch": 1})
    assert report.last_logged_step(tmp_path) is None


def test_the_log_file_keeps_the_root_cause_panel_before_the_lines_that_follow_it_on_the_terminal(tmp_path):
    """``restarts exhausted`` (or a lost node's line) follows the panel on the terminal; dlaunch.log had it before
    the panel, which was written to the file only with summary.json."""
    import logging

    handler = logging.FileHandler(tmp_path / "dlaunch.log")
    logging.getLogger().addHandler(handler)
    try:
        restarting = spec().model_copy(update={"launch": spec().launch.model_copy(update={"max_restarts": 1})})
        assert report.report_failures([cause(1)], [], restarting, tmp_path) == 1
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    log = (tmp_path / "dlaunch.log").read_text()
    assert log.index("worker rank 1 failed: root cause") < log.index("restarts exhausted"), log
    assert log.count("worker rank 1 failed: root cause") == 1, log


def test_ranks_a_stop_killed_are_named_with_what_they_did_and_where_in_their_own_code(tmp_path):
    """`rank 1 (train step 5) did not exit ...` said nothing of the line a hung rank sat on, which its heartbeat
    records (and the collective-timeout message names)."""
    spec = compose_and_validate(["cluster.device=cpu"], cuda_devices=0)
    for rank, beat in ((0, {"operation": "train step 5", "where": "train_step (slow.py:29)"}),
                       (1, {"operation": "stop-signal agreement after step 4", "where": ""})):
        outputs.progress_file(tmp_path, rank).parent.mkdir(parents=True, exist_ok=True)
        outputs.progress_file(tmp_path, rank).write_text(json.dumps({"step": 4, **beat}))
    text = report.killed_on_stop(spec, tmp_path, [0, 1, 2])
    assert text.startswith("rank 0 (train step 5, at train_step (slow.py:29)), rank 1 (stop-signal agreement after "
                           "step 4), rank 2 did not exit within launch.stop_grace_s="), text
