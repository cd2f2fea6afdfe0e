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
