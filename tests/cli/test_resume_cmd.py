"""After a signal dlaunch prints the resume command; ``dlaunch resume RUN_DIR`` continues the run in its directory."""

from __future__ import annotations

import signal

import pytest

from launcher.checkpoint import layout
from tests.conftest import FIXTURES, PROBE, dlaunch, summary
from tests.launch.test_restarts import logged_steps
from tests.launch.test_signals import stop_with

pytestmark = pytest.mark.slow


def test_sigterm_prints_the_resume_command_and_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    code, _, out = stop_with(run_dir, signal.SIGTERM, "strategy=one_device", "cluster=1x1", in_process=True)
    assert code == 143, out[-3000:]
    assert f"resume with: dlaunch resume {run_dir}" in out, out[-3000:]
    step = layout.read_manifest(layout.latest(run_dir / "checkpoints"))["step"]
    proc = dlaunch("resume", str(run_dir), f"trainer.steps={step + 3}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from step {step}" in proc.stdout
    assert logged_steps(run_dir) == list(range(1, step + 4))


def test_resume_names_a_directory_that_is_not_a_run(tmp_path):
    proc = dlaunch("resume", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{tmp_path} is not a dlaunch run or sweep directory" in proc.stderr
    (tmp_path / "multirun" / "lr_sweep").mkdir(parents=True)
    proc = dlaunch("resume", "multirun/lr_swep", cwd=tmp_path)  # a typo: no such directory, and the one beside it
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"multirun/lr_swep: no such directory; did you mean {tmp_path}/multirun/lr_sweep?" in proc.stderr, proc.stderr


@pytest.mark.parametrize("form", ["config-dir name", "path", "path, quoted"])
def test_resume_runs_a_users_own_recipe_again(tmp_path, form):
    """Hydra records the stored option (recipe=user/NAME); the run directory keeps what the user typed instead."""
    assert dlaunch("recipes", "cp", "linear", str(tmp_path / "proj") + "/", cwd=tmp_path).returncode == 0
    (tmp_path / "proj" / "recipe" / "linear.yaml").rename(tmp_path / "proj" / "recipe" / "mine.yaml")
    if form == "path, quoted":  # a directory name Hydra's grammar would misread unquoted
        (tmp_path / "proj").rename(tmp_path / "my proj (1)")
    chosen = {"config-dir name": ("--config-dir", str(tmp_path / "proj"), "recipe=mine"),
              "path": ("recipe=proj/recipe/mine.yaml",),
              "path, quoted": ("recipe='my proj (1)/recipe/mine.yaml'",)}[form]
    run_dir = tmp_path / "run"
    first = dlaunch(*chosen, "trainer.steps=4", "trainer.log_every=1", "trainer.checkpoint.every_steps=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    recorded = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "user/" not in recorded, recorded
    elsewhere = tmp_path / "elsewhere"  # a relative path was made absolute: resume works from any directory
    elsewhere.mkdir()
    again = dlaunch("resume", str(run_dir), "trainer.steps=6", cwd=elsewhere)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "from step 4" in again.stdout
    assert logged_steps(run_dir) == list(range(1, 7))


def test_resume_composes_the_runs_own_primary_config_again(tmp_path):
    """A run composed from --config-dir cfg --config-name myrun resumes from that config, not dlaunch's default
    (which picks recipe=linear: the resume used to retrain another recipe in the run's directory)."""
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "myrun.yaml").write_text("defaults:\n  - config\n  - override recipe: digits\n  - _self_\n"
                                    "trainer:\n  steps: 4\n  log_every: 1\n  checkpoint:\n    every_steps: 2\n")
    run_dir = tmp_path / "run"
    first = dlaunch("--config-dir", str(cfg), "--config-name", "myrun", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = dlaunch("resume", str(run_dir), "trainer.steps=6", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "--config-name myrun" in again.stderr and "from step 4" in again.stdout
    assert summary(run_dir)["recipe"] == "digits" and logged_steps(run_dir) == list(range(1, 7))
    before = summary(run_dir)
    done = dlaunch("resume", str(run_dir), "trainer.steps=6", cwd=tmp_path)  # nothing left to train
    assert done.returncode == 0 and "completed already (summary.json, 6 steps)" in done.stdout + done.stderr, done.stderr[-3000:]
    assert summary(run_dir) == before  # its throughput and wall time stand, not this command's 0 steps


def test_rerun_keeps_the_order_drops_a_dry_run_and_carries_a_sweeps_hydra_overrides(tmp_path):
    from omegaconf import OmegaConf

    from launcher.cli.resume import rerun_args

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(["trainer.seed=1", "launch.dry_run=true", "trainer.steps=9", "trainer.resume=never",
                                     "trainer.steps=90"]), run / ".hydra" / "overrides.yaml")
    assert rerun_args(run, ["trainer.steps=20"]) == [
        "trainer.seed=1", "trainer.steps=20", "trainer.resume=auto", f"hydra.run.dir={run}"]  # in place, dry run gone
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    OmegaConf.save(OmegaConf.create({"hydra": {
        "overrides": {"hydra": [f"hydra.sweep.dir={sweep}", "hydra.mode=MULTIRUN", "hydra/launcher=submitit_local"],
                      "task": ["trainer.seed=1,2", "trainer.steps=9"]},
        "job": {"config_name": "config"}, "runtime": {"config_sources": []}}}), sweep / "multirun.yaml")
    assert rerun_args(sweep, ["trainer.steps=20"]) == [
        "-m", "hydra/launcher=submitit_local", "trainer.seed=1,2", "trainer.steps=20", "trainer.resume=auto",
        f"hydra.sweep.dir={sweep}"]


def test_a_sweep_of_a_users_recipe_without_checkpoints_resumes_keeping_its_completed_jobs(tmp_path):
    """The sweep records what the user typed (recipe=mine.py, not dlaunch's stored option), and a completed job with
    no checkpoint is kept as it is, not trained again from step 0 over its results."""
    assert dlaunch("recipes", "cp", "linear", str(tmp_path), cwd=tmp_path).returncode == 0
    sweep = tmp_path / "sweep"
    first = dlaunch("-m", "recipe=linear.py", "trainer.seed=1,2", "trainer.steps=3", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = [(sweep / n / "metrics.jsonl").read_bytes() for n in "01"]
    again = dlaunch("resume", str(sweep), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (again.stdout + again.stderr).count("completed already (summary.json") == 2
    assert [(sweep / n / "metrics.jsonl").read_bytes() for n in "01"] == before
    assert [summary(sweep / n)["status"] for n in "01"] == ["completed", "completed"]
    assert "sweep summary: 2 jobs" in again.stdout  # the completed jobs are this command's jobs too


def test_a_job_not_started_after_a_stop_keeps_its_earlier_completed_results(tmp_path):
    import json

    from rich.console import Console

    from launcher.cli.sweep_jobs import not_started

    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "final_loss": 0.5}))
    not_started(tmp_path, "job 0 was stopped by SIGINT", Console(file=open(tmp_path / "out.txt", "w")))
    assert summary(tmp_path) == {"status": "completed", "final_loss": 0.5}


WRAPPED = FIXTURES / "wrapped_recipe.py"


def records(run_dir) -> dict:
    """What a refused command must leave as it was: Hydra's record of the run, its summary and config."""
    files = [*sorted((run_dir / ".hydra").iterdir()), run_dir / "summary.json", run_dir / "config.yaml"]
    return {p.name: p.read_bytes() for p in files if p.exists()}


def test_a_refused_command_leaves_the_run_it_would_replace_as_it_was(tmp_path):
    """A command refused in a run's directory (here: its checkpoint is past the new trainer.steps) writes nothing
    there, so `dlaunch resume` still replays the run's own command."""
    run_dir = tmp_path / "run"
    own = ("trainer.steps=4", "trainer.checkpoint.every_steps=2", f"hydra.run.dir={run_dir}")
    assert dlaunch(*own, cwd=tmp_path).returncode == 0
    before = records(run_dir)
    refused = dlaunch("trainer.steps=2", "recipe.optimizer.lr=0.9", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert refused.returncode == 2 and "past trainer.steps" in " ".join(refused.stderr.split()), refused.stderr[-3000:]
    assert records(run_dir) == before
    again = dlaunch("resume", str(run_dir), cwd=tmp_path)
    assert again.returncode == 0 and "recipe.optimizer.lr=0.9" not in again.stderr, again.stderr[-3000:]


def test_a_resume_for_other_steps_of_a_completed_run_without_checkpoints_is_refused_and_keeps_it(tmp_path):
    """A completed run with checkpoints off, resumed for more (or fewer) steps: there is nothing to go on from, and it
    used to train again from step 0 over the run's own results, exit 0. trainer.resume=never asks for that."""
    run_dir = tmp_path / "run"
    assert dlaunch("trainer.steps=3", f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    before = {**records(run_dir), "metrics": (run_dir / "metrics.jsonl").read_bytes()}
    for steps in (5, 2):
        refused = dlaunch("resume", str(run_dir), f"trainer.steps={steps}", cwd=tmp_path)
        text = " ".join(refused.stderr.split())
        assert refused.returncode == 2 and "Traceback" not in text, refused.stderr[-3000:]
        assert (f"trainer.steps = {steps} {run_dir} completed 3 steps with no checkpoint of its own (checkpoints are off "
                f"(trainer.checkpoint.every_steps=0)): a resume would train it again from step 0 over its results. For "
                f"{steps} steps: a new run, or trainer.resume=never here") in text
        assert "..." not in text  # the whole reason, not cut at the screen's limit
        assert {**records(run_dir), "metrics": (run_dir / "metrics.jsonl").read_bytes()} == before
    again = dlaunch("resume", str(run_dir), "trainer.steps=5", "trainer.resume=never", cwd=tmp_path)
    assert again.returncode == 0 and summary(run_dir)["steps"] == 5, again.stderr[-3000:]
    # a fine-tune with no checkpoint of its own went back to the checkpoint it started from, over its results
    base, tune = tmp_path / "base", tmp_path / "tune"
    assert dlaunch("trainer.steps=2", "trainer.checkpoint.every_steps=2", f"hydra.run.dir={base}", cwd=tmp_path).returncode == 0
    step2 = base / "checkpoints" / "step-00000002"
    assert dlaunch("trainer.steps=4", f"trainer.resume={step2}", f"hydra.run.dir={tune}", cwd=tmp_path).returncode == 0
    kept = (tune / "metrics.jsonl").read_bytes()
    refused = dlaunch("resume", str(tune), "trainer.steps=6", cwd=tmp_path)
    assert refused.returncode == 2 and f"a resume would train it again from {step2}, where it started" in " ".join(
        refused.stderr.split()), refused.stderr[-3000:]
    assert (tune / "metrics.jsonl").read_bytes() == kept


def test_a_sweep_resumed_for_other_steps_without_checkpoints_keeps_its_completed_rows(tmp_path):
    """Job 0 (no checkpoints) is refused as a lone run is, job 1 goes on from its own; the sweep's table listed the
    refused one as a config error with no final loss, then (once it kept its row) left it out."""
    import json

    sweep = tmp_path / "sweep"
    first = dlaunch("-m", "trainer.steps=3", "trainer.checkpoint.every_steps=0,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = dlaunch("resume", str(sweep), "trainer.steps=5", cwd=tmp_path)
    assert again.returncode == 2 and " ".join(again.stderr.split()).count("with no checkpoint of its own (") == 1
    rows = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [(r["job"], r["status"], r["final_loss"] is not None) for r in rows] == [(0, "completed", True),
                                                                                  (1, "completed", True)], rows
    assert (summary(sweep / "0")["steps"], summary(sweep / "1")["steps"]) == (3, 5)
    assert "sweep summary: 2 jobs" in again.stdout, again.stdout[-3000:]


def test_a_resume_that_trains_nothing_leaves_the_run_it_would_replace_as_it_was(tmp_path):
    """A resume whose model no longer fits the checkpoint fails in its workers (the model's names changed: the
    launcher compares shapes by name); it had recorded its overrides, so every later plain `dlaunch resume` failed
    the same way."""
    run_dir = tmp_path / "run"
    assert dlaunch("cluster.device=cpu", "trainer.steps=4", "trainer.checkpoint.every_steps=2", f"recipe.entry={WRAPPED}",
                   f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    before = records(run_dir)
    failed = dlaunch("resume", str(run_dir), "+recipe.wrap=true", "trainer.steps=6", cwd=tmp_path)
    text = " ".join(failed.stdout.split() + failed.stderr.replace("│", " ").split())
    assert failed.returncode == 1 and "does not fit this run's model or optimizer" in text, failed.stderr[-3000:]
    assert "the model has 0.bias, 0.weight that the checkpoint lacks, and the checkpoint holds bias, weight" in text
    assert "nothing was trained past the checkpoint it resumed from, so the run's command" in text
    command = lambda files: {name: data for name, data in files.items() if name != "summary.json"}  # noqa: E731
    assert command(records(run_dir)) == command(before)
    assert summary(run_dir)["status"] == "failed"  # what this command did, and why (error.txt)
    again = dlaunch("resume", str(run_dir), "trainer.steps=6", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 4


def test_a_fine_tune_from_another_runs_checkpoint_that_fails_keeps_its_own_record(tmp_path):
    """trainer.resume=PATH of another run: a failure there is this run's own, recorded as any failure is."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert dlaunch("cluster.device=cpu", "trainer.steps=4", "trainer.checkpoint.every_steps=2", f"hydra.run.dir={first}",
                   cwd=tmp_path).returncode == 0
    proc = dlaunch("cluster.device=cpu", "trainer.steps=6", f"recipe.entry={WRAPPED}", "+recipe.wrap=true",
                   f"hydra.run.dir={second}", f"trainer.resume={first}/checkpoints/step-00000004", cwd=tmp_path)
    assert proc.returncode == 1 and "kept as it was" not in proc.stdout + proc.stderr  # names differ: the load fails
    assert summary(second)["status"] == "failed" and (second / "error.txt").is_file()
    assert "+recipe.wrap=true" in (second / ".hydra" / "overrides.yaml").read_text()


def test_resuming_a_fine_tune_that_saved_nothing_yet_starts_from_its_path_again(tmp_path):
    """`dlaunch resume` of a trainer.resume=PATH run that failed before its own first save: from PATH again, as the
    stop's hint says (before, the recorded PATH became trainer.resume=auto, and it trained from step 0)."""
    base, tune = tmp_path / "base", tmp_path / "tune"
    assert dlaunch("trainer.steps=4", "trainer.checkpoint.every_steps=2", f"hydra.run.dir={base}", cwd=tmp_path).returncode == 0
    step4 = base / "checkpoints" / "step-00000004"
    proc = dlaunch(f"recipe.entry={PROBE}", "trainer.steps=12", "trainer.checkpoint.every_steps=10", f"trainer.resume={step4}",
                   "+recipe.fail_replica=0", "+recipe.fail_step=2", f"hydra.run.dir={tune}", cwd=tmp_path)
    assert proc.returncode == 1 and layout.latest(tune / "checkpoints") is None, proc.stderr[-3000:]
    again = dlaunch("resume", str(tune), "+recipe.fail_replica=-1", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"from step 4 ({step4}" in again.stdout and summary(tune)["resumed_from_step"] == 4, again.stdout[-3000:]
    assert dlaunch("resume", str(tune), "trainer.steps=14", cwd=tmp_path).returncode == 0  # its own checkpoints now
    assert summary(tune)["resumed_from_step"] == 12


def test_a_sweep_refused_in_an_earlier_sweeps_directory_reports_its_own_jobs_and_keeps_the_earlier(tmp_path):
    import json

    sweep = tmp_path / "sweep"
    first = dlaunch("-m", "trainer.steps=4", "trainer.checkpoint.every_steps=2", "recipe.optimizer.lr=0.05,0.02",
                    f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {n: records(sweep / n) for n in "01"}
    recorded = (sweep / "multirun.yaml").read_bytes()
    again = dlaunch("-m", "trainer.steps=2", "trainer.checkpoint.every_steps=2", "recipe.optimizer.lr=0.5,0.3",
                    "hydra.sweep.dir=sweep", cwd=tmp_path)  # relative, as the default sweep directory is
    assert again.returncode != 0 and again.stderr.count("past trainer.steps") == 2, again.stderr[-3000:]
    rows = json.loads((sweep / "sweep_summary.json").read_text())["jobs"]
    assert [(r["overrides"].split()[2], r["status"], r["final_loss"]) for r in rows] == [
        ("recipe.optimizer.lr=0.5", "config error", None), ("recipe.optimizer.lr=0.3", "config error", None)], rows
    assert all("past trainer.steps" in r["error"] for r in rows)
    assert "completed" not in again.stdout.split("sweep summary", 1)[1], again.stdout
    assert {n: records(sweep / n) for n in "01"} == before and (sweep / "multirun.yaml").read_bytes() == recorded


ARGV_SCRIPT = """import json, os, pathlib, sys
if os.environ.get("RANK", "0") == "0":
    with open(pathlib.Path(__file__).with_name("argv.jsonl"), "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def test_resume_runs_a_script_again_with_its_arguments_unless_given_new_ones(tmp_path):
    """The stop message promises "the same arguments": they follow ``--``, outside Hydra's overrides. And from any
    directory: the command runs where it was first typed."""
    import json

    (tmp_path / "argv.py").write_text(ARGV_SCRIPT)
    run_dir = tmp_path / "run"
    first = dlaunch("script=argv.py", "strategy=mirrored", "cluster=1x2", f"hydra.run.dir={run_dir}", "--", "--epochs", "5",
                    "--name", "a b", "--fmt", "${x}", cwd=tmp_path)  # no interpolation for OmegaConf to resolve
    assert first.returncode == 0, first.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"  # script=argv.py is relative: resumed from where the run was started
    elsewhere.mkdir()
    again = dlaunch("resume", str(run_dir), cwd=elsewhere, device=None)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"cd {tmp_path} && dlaunch script=argv.py" in again.stderr  # the command it runs, as typed
    assert "-- --epochs 5 --name 'a b' --fmt '${x}'" in again.stderr
    warm = "forked from a process that imported torch"  # the workers start as the run's own command started them
    assert warm in first.stdout + first.stderr and warm in again.stdout + again.stderr, again.stderr[-3000:]
    new = dlaunch("resume", str(run_dir), "--", "--epochs", "7", cwd=tmp_path, device=None)
    assert new.returncode == 0, new.stderr[-3000:]
    seen = [json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines()]
    assert seen == [["--epochs", "5", "--name", "a b", "--fmt", "${x}"]] * 2 + [["--epochs", "7"]]


@pytest.mark.slow
def test_a_sweeps_jobs_keep_their_own_checkpoint_dirs_on_resume(tmp_path):
    """OPERATIONS.md gives each sweep job its own checkpoints with ``trainer.checkpoint.dir=.../${hydra:job.num}``.
    `dlaunch resume SWEEP` failed on it ("Unsupported interpolation type hydra"), and `dlaunch resume SWEEP/0`
    replayed it without a job number: /ckpt/None, no checkpoint there, and job 0 trained again from step 0."""
    sweep = tmp_path / "sweep"
    first = dlaunch("-m", "trainer.steps=4", "trainer.checkpoint.every_steps=2", "trainer.seed=1,2",
                    f"hydra.sweep.dir={sweep}", "trainer.checkpoint.dir=" + str(tmp_path / "ck" / "${hydra:job.num}"),
                    cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    proc = dlaunch("resume", str(sweep), "trainer.steps=6", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [summary(sweep / n)["resumed_from_step"] for n in "01"] == [4, 4]
    proc = dlaunch("resume", str(sweep / "1"), "trainer.steps=8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(sweep / "1")["resumed_from_step"] == 6
    assert [p.name for p in layout.complete_steps(tmp_path / "ck" / "1")][-1] == "step-00000008"
    assert not (tmp_path / "ck" / "None").exists()


def test_a_failed_run_points_at_its_newest_checkpoint_and_resume_goes_on_from_it(tmp_path):
    """A failure said its root cause and nothing of the checkpoint it left; once fixed, resume goes on from there."""
    run_dir = tmp_path / "run"
    proc = dlaunch(f"recipe.entry={PROBE}", "+recipe.fail_replica=0", "+recipe.fail_step=8", "trainer.steps=12",
                   "trainer.checkpoint.every_steps=5", "trainer.log_every=1", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert f"newest checkpoint: {run_dir / 'checkpoints' / 'step-00000005'}" in out, out[-3000:]
    assert f"once the cause is fixed, go on from it with: dlaunch resume {run_dir}" in out
    proc = dlaunch("resume", str(run_dir), "+recipe.fail_step=100", cwd=tmp_path)  # the cause fixed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "from step 5" in proc.stdout and summary(run_dir)["status"] == "completed", proc.stdout[-3000:]
    assert logged_steps(run_dir)[-7:] == list(range(6, 13))


def test_a_failure_after_trained_steps_with_checkpoints_off_says_they_are_lost_and_how_to_keep_them(tmp_path):
    """An evaluate() that raised at the end of a run with checkpoints off (the default) showed its root cause and
    nothing of the trained steps it lost with it."""
    import json

    from launcher.cli.resume_lines import after_failure
    from launcher.config.compose import compose_and_validate

    spec = compose_and_validate(["trainer.steps=20", "cluster.device=cpu"], cuda_devices=0)
    assert after_failure(spec, tmp_path) == ""  # no summary: nothing known to be trained
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "last_completed_step": 20}))
    told = after_failure(spec, tmp_path)
    assert told.startswith("nothing was saved: the run failed after its last step (in the final evaluation, or as it "
                           "ended) with checkpoints off, and the training up to step 20 is lost; with "
                           "trainer.checkpoint.every_steps=N")
    assert told.endswith("(after the last step, only the evaluation runs again)")
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "last_completed_step": 7}))
    assert "failed after step 7 with checkpoints off" in after_failure(spec, tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "last_completed_step": 0}))
    assert after_failure(spec, tmp_path) == ""  # a failure before the first step lost nothing
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "last_completed_step": 20}))
    assert after_failure(spec, tmp_path) == ""  # an earlier run's record (this failure could not write its own)
    saving = compose_and_validate(["trainer.checkpoint.every_steps=10", "cluster.device=cpu"], cuda_devices=0)
    assert after_failure(saving, tmp_path) == ""  # checkpoints on, none yet: as before


def test_a_failure_to_load_a_damaged_newest_checkpoint_says_a_resume_passes_it_over(tmp_path):
    """A restart checks sizes alone: a committed checkpoint damaged in place (same size) failed every attempt's load,
    and the last line named it as what `dlaunch resume` goes on from (which verifies it, and passes it over)."""
    import json

    from launcher.cli import resume_lines
    from tests.checkpoint.test_integrity import flip_a_bit, save_steps, spec_for

    _, forty = save_steps(tmp_path, 20, 40)
    flip_a_bit(forty)
    said = resume_lines.after_failure(spec_for(), tmp_path)
    assert said.startswith(f"newest checkpoint: {forty}\n"), said  # another failure: nothing read
    error = {"exception": f"CheckpointError: cannot load {forty}: RuntimeError: PytorchStreamReader failed"}
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "error": error}))
    said = resume_lines.after_failure(spec_for(), tmp_path)
    assert said.startswith(f"newest checkpoint: {forty} is damaged: __0_0.distcp does not match its sha256"), said
    assert said.endswith("goes on from the newest intact one") and "dlaunch resume" in said, said


def test_a_completed_runs_own_command_again_keeps_its_summary_when_its_last_step_is_saved(tmp_path):
    """The same command again into the same directory (a sweep run again into its own) resumed from the last step's
    checkpoint, trained nothing, and replaced summary.json's throughput and wall time with those of no step."""
    run_dir = tmp_path / "run"
    args = ("trainer.steps=4", "trainer.checkpoint.every_steps=2", f"hydra.run.dir={run_dir}")
    assert dlaunch(*args, cwd=tmp_path).returncode == 0
    before = summary(run_dir)
    again = dlaunch(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (f"{run_dir}: completed already (summary.json, 4 steps): nothing to resume; trainer.resume=never trains it "
            "again from step 0") in " ".join((again.stdout + again.stderr).split()), again.stderr
    assert summary(run_dir) == before
    other = dlaunch(*args, "trainer.seed=7", cwd=tmp_path)  # another config: not this run's command, as before
    assert other.returncode == 0 and "completed already" not in other.stdout + other.stderr, other.stderr[-3000:]
    longer = dlaunch(*args, "trainer.steps=6", cwd=tmp_path)  # more steps: it goes on from step 4, as before
    assert longer.returncode == 0 and "from step 4" in longer.stdout and summary(run_dir)["steps"] == 6, longer.stdout
