"""The run directory's files: a resumed run's metrics and the history summary.json counts."""

from __future__ import annotations

from launcher.runtime import outputs


def test_a_resumed_run_keeps_its_metrics_up_to_the_checkpoint_and_logs_each_step_once(tmp_path):
    path = tmp_path / outputs.METRICS
    log = outputs.MetricsLog(path)
    for step in range(1, 8):  # killed after step 7; the checkpoint is at step 4
        log.write({"step": step, "loss": float(step)})
    log.close()
    path.write_text(path.read_text() + '{"step": 8, "lo')  # a torn last line
    log = outputs.MetricsLog(path, resumed_at=4)
    for step in range(5, 9):
        log.write({"step": step, "loss": float(step)})
    log.close()
    assert [r["step"] for r in outputs.read_records(path)] == list(range(1, 9))


def test_the_history_counts_commands_restarts_and_resumes_until_a_fresh_start(tmp_path):
    outputs.record_command(tmp_path)
    outputs.record_start(tmp_path, restart=0, resumed_from_step=0)
    outputs.record_start(tmp_path, restart=1, resumed_from_step=4)  # a worker was killed
    outputs.record_command(tmp_path)  # the same command again, after dlaunch was killed
    outputs.record_start(tmp_path, restart=0, resumed_from_step=8)
    assert outputs.history(tmp_path) == {"commands": 2, "restarts": 1, "resumes": 2}
    assert outputs.command_restarts(tmp_path) == 0  # the last command's own: its workers never restarted
    outputs.record_start(tmp_path, restart=1, resumed_from_step=8)
    assert outputs.command_restarts(tmp_path) == 1
    outputs.start_run(tmp_path, resuming=True)
    assert outputs.history(tmp_path)["commands"] == 2
    outputs.start_run(tmp_path, resuming=False)
    assert outputs.history(tmp_path) == {"commands": 0, "restarts": 0, "resumes": 0}


def test_a_run_that_ends_early_counts_its_wall_seconds_from_this_commands_last_start(tmp_path, monkeypatch):
    """A failed or stopped run's summary.json had wall_seconds null: a sweep's `wall s` showed nothing for a job
    that failed after hours. Now it is the time since the last start of this command's workers."""
    clock = [1000.0]
    monkeypatch.setattr(outputs.time, "time", lambda: clock[0])
    outputs.record_command(tmp_path)
    assert outputs.since_start(tmp_path) is None  # a build error: the workers never started training
    outputs.record_start(tmp_path, restart=0, resumed_from_step=0)
    clock[0] = 1030.0
    outputs.record_start(tmp_path, restart=1, resumed_from_step=0)  # restarted: the last attempt's time, as completed
    clock[0] = 1042.5
    assert outputs.since_start(tmp_path) == 12.5
    outputs.record_command(tmp_path)  # the next command, before its workers started: not the last command's
    assert outputs.since_start(tmp_path) is None


def test_a_script_run_keeps_its_own_metrics_and_history_and_counts_its_resumes(tmp_path):
    """metrics.jsonl is a script's own file (start_run(script=True): the directory's last run was of that script);
    only its ScriptCheckpoints.restore knows that it resumed."""
    (tmp_path / outputs.METRICS).write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / outputs.SUMMARY).write_text("{}\n")
    outputs.record_command(tmp_path)
    outputs.start_run(tmp_path, script=True)
    outputs.record_command(tmp_path)
    outputs.record_resume(tmp_path, 10)
    assert (tmp_path / outputs.METRICS).read_text() == '{"step": 1, "loss": 2.0}\n'
    assert not (tmp_path / outputs.SUMMARY).exists()
    assert outputs.history(tmp_path) == {"commands": 2, "restarts": 0, "resumes": 1}


def test_the_latest_timeline_replaces_the_steps_a_resumed_script_logs_again():
    """Logged to step 13, resumed from step 10: steps 11-13 come again and replace the first ones. An evaluation's
    record at the step of a training record is the same timeline; a record without a step is kept."""
    first = [{"step": s, "loss": 10.0 - s} for s in range(1, 14)] + [{"note": "no step"}]
    again = [{"step": 10, "eval_loss": 4.0}, *({"step": s, "loss": 20.0 - s} for s in range(11, 16))]
    kept = outputs.latest_timeline(first + again)
    assert [(r.get("step"), r.get("loss")) for r in kept if "loss" in r] == \
        [*((s, 10.0 - s) for s in range(1, 11)), *((s, 20.0 - s) for s in range(11, 16))]
    assert {"step": 10, "eval_loss": 4.0} in kept and {"note": "no step"} in kept
    logged_twice = [{"step": 20, "loss": 1.0}, {"step": 20, "loss": 0.5}]  # log_every 10, resumed from step 15
    assert outputs.latest_timeline(logged_twice) == [{"step": 20, "loss": 0.5}]
    by_epoch = [{"step": 100, "loss": 1.0}, {"step": 1, "val_loss": 2.0}, {"step": 200, "loss": 0.5},
                {"step": 2, "val_loss": 1.5}]  # an epoch's step is not a step back from the steps' own
    assert outputs.latest_timeline(by_epoch) == by_epoch


def test_a_script_run_keeps_the_directory_s_records_only_after_a_run_of_the_same_script(tmp_path):
    (tmp_path / outputs.CONFIG).write_text("script:\n  path: /work/train.py\n  args: []\n")
    assert outputs.same_script(tmp_path, "/work/train.py") and not outputs.same_script(tmp_path, "/work/other.py")
    (tmp_path / outputs.CONFIG).write_text("script: null\nrecipe:\n  name: linear\n")
    assert not outputs.same_script(tmp_path, "/work/train.py") and not outputs.same_script(tmp_path / "none", "x")


def test_a_scripts_summary_takes_its_last_loss_and_its_own_metrics_from_its_records(tmp_path):
    (tmp_path / outputs.METRICS).write_text(
        '{"step": 1, "loss": 3.0, "lr": 0.1}\n{"step": 2, "loss": 2.0, "acc": 0.5, "note": "x"}\n'
        '{"step": 2, "eval_accuracy": 0.75}\n{"step": 3, "loss": NaN}\n')
    assert outputs.script_results(tmp_path) == {"final_loss": 2.0, "last_logged_step": 2,
                                                "metrics": {"acc": 0.5, "eval_accuracy": 0.75}}
    assert outputs.script_results(tmp_path / "none") == {}


def test_a_scripts_jobs_rank_by_their_final_loss_unless_an_objective_is_named(tmp_path):
    """A recipe's evaluate() orders its metrics on purpose; a script's come in the order it logged them."""
    summary = {"final_loss": 0.5, "metrics": {"epoch": 3, "accuracy": 0.9}}
    (tmp_path / outputs.HYDRA_RECORD).mkdir()
    (tmp_path / outputs.HYDRA_RECORD / "overrides.yaml").write_text("[]\n")
    (tmp_path / outputs.CONFIG).write_text("script:\n  path: /work/train.py\nsweep:\n  objective: final_loss\n")
    assert outputs.ranking_metric(tmp_path, summary) is None
    (tmp_path / outputs.CONFIG).write_text("script:\n  path: /work/train.py\nsweep:\n  objective: accuracy\n")
    assert outputs.ranking_metric(tmp_path, summary) == "accuracy"
    (tmp_path / outputs.CONFIG).write_text("script: null\nsweep:\n  objective: final_loss\n")
    assert outputs.ranking_metric(tmp_path, summary) == "epoch"  # a recipe's first metric, as before
