"""How each step trains, end to end (issue 15): precision, accumulation, clipping, the schedule and evaluation
under every strategy, resumed bit for bit, with real dlaunch processes on the CPU (``cluster.device=cpu``)."""

from __future__ import annotations

import json

import pytest

from tests.checkpoint.test_resume import assert_bitwise_equal, final_state, losses, run_ok
from tests.conftest import FIXTURES, summary

pytestmark = pytest.mark.slow

OPTIONS = ("trainer.steps=12", "trainer.log_every=2", "trainer.precision=bf16-mixed", "trainer.grad_accum_steps=2")
SCHEDULE = ("trainer.lr_schedule.decay=cosine", "trainer.lr_schedule.warmup_steps=3", "trainer.clip_grad_norm=5.0")
STRATEGIES = {
    "one_device": ("strategy=one_device", *SCHEDULE),
    "mirrored": ("strategy=mirrored", "cluster=1x2", *SCHEDULE),
    "multi_worker_mirrored": ("strategy=multi_worker_mirrored", "cluster=2x1", *SCHEDULE),
    "central_storage": ("strategy=central_storage", "strategy.compute_devices=[cpu:0,cpu:1]", *SCHEDULE),
    "mesh": ("recipe=tp_mlp", "strategy=mesh", "cluster=1x2", *SCHEDULE),
    # the ps tasks own the optimizer: no schedule or clipping there (refused with a reason, tests/config)
    "parameter_server": ("recipe=wide_deep", "strategy=parameter_server", "cluster.workers=1", "cluster.ps=1"),
}


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_trains_in_bf16_with_accumulation(run_dlaunch, strategy):
    args = STRATEGIES[strategy]
    proc, run_dir = run_dlaunch(*OPTIONS, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bf16 autocast on cpu" in proc.stdout  # the plan
    logged = [r for r in records(run_dir) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 4, 6, 8, 10, 12]
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert all(r["lr"] > 0 for r in logged)
    if "trainer.lr_schedule.decay=cosine" in args:
        lrs = [r["lr"] for r in logged]
        assert lrs[0] < lrs[1] < lrs[2] and lrs[2] > lrs[-1]  # warm-up, then the decay
        assert all(r["grad_norm"] > 0 for r in logged)
    assert summary(run_dir)["precision"] == "bf16-mixed"


RECOMPUTED = {
    # the recompute inside FSDP2's per-block gather (dropout on), and inside DTensor's split layers
    "fsdp": ("TransformerEncoderLayer", "recipe=charlm", "recipe.dropout=0.1", "strategy=fsdp", "cluster=1x2",
             "strategy.wrap=[TransformerEncoderLayer]"),
    "mesh": ("Linear", "recipe=tp_mlp", "strategy=mesh", "cluster=1x2"),
}


@pytest.mark.parametrize("strategy", list(RECOMPUTED))
def test_recomputed_blocks_train_bit_for_bit_as_kept_activations_do(run_dlaunch, strategy):
    name, *args = RECOMPUTED[strategy]
    common = ("trainer.steps=4", "trainer.log_every=1", "input.global_batch_size=8", *args)
    kept_proc, kept = run_dlaunch(*common, name="kept")
    proc, recomputed = run_dlaunch(*common, f"trainer.activation_checkpointing=[{name}]", name="recomputed")
    assert kept_proc.returncode == 0 and proc.returncode == 0, (kept_proc.stderr + proc.stderr)[-3000:]
    assert f"recompute {name} in backward" in proc.stdout  # the plan
    assert f"module(s) of {name} recompute their forward in backward" in proc.stdout + proc.stderr
    assert losses(recomputed) == losses(kept) and len(losses(kept)) == 4


def test_a_class_the_recipes_model_lacks_ends_the_run_before_the_first_step_naming_its_classes(run_dlaunch):
    proc, _ = run_dlaunch("recipe=digits", "trainer.activation_checkpointing=[Block]", "trainer.steps=5")
    assert proc.returncode == 1
    out = " ".join((proc.stdout + proc.stderr).replace("│", " ").split())
    assert out.count("trainer.activation_checkpointing names Block, but ") == 1 and "Traceback" not in out
    assert "its module types are: " in out and "step 1" not in out


def test_accumulation_trains_like_the_whole_batch_at_once(run_dlaunch):
    """Mirrored 1x2 with 2 micro-batches of 16 per replica ends where one device with batches of 64 does."""
    common = ("trainer.steps=20", "trainer.checkpoint.every_steps=20", "recipe.examples=640")
    _, whole_dir = run_ok(run_dlaunch, "whole", *common, "strategy=one_device")
    _, micro_dir = run_ok(run_dlaunch, "micro", *common, "strategy=mirrored", "cluster=1x2", "trainer.grad_accum_steps=2")
    (whole, _), (micro, _) = final_state(whole_dir), final_state(micro_dir)
    for key in whole:
        # sums of the same terms in another order: a few float32 roundings per step, 20 steps
        assert whole[key].allclose(micro[key], rtol=1e-5, atol=1e-6), key


def test_a_resume_restores_the_schedule_the_scaler_and_the_loss_curve_bit_for_bit(run_dlaunch):
    common = ("strategy=mirrored", "cluster=1x2", "recipe.examples=640", "trainer.log_every=1", "trainer.steps=30",
              "trainer.checkpoint.every_steps=5", "trainer.checkpoint.keep=10", "trainer.precision=fp16-mixed",
              "trainer.grad_accum_steps=2", "trainer.clip_grad_norm=2.0", "trainer.lr_schedule.decay=linear",
              "trainer.lr_schedule.warmup_steps=6", "trainer.lr_schedule.min_lr_ratio=0.2")
    _, straight = run_ok(run_dlaunch, "straight", *common)
    middle = straight / "checkpoints" / "step-00000015"
    proc, resumed = run_ok(run_dlaunch, "resumed", *common, f"trainer.resume={middle}")
    assert "resumed from" in proc.stdout + proc.stderr
    for a, b in zip(final_state(straight), final_state(resumed)):
        assert_bitwise_equal(a, b)
    ahead = {r["step"]: r for r in records(straight) if "loss" in r}
    for r in (r for r in records(resumed) if "loss" in r):  # the end's evaluation is a record of its own
        assert r["lr"] == ahead[r["step"]]["lr"] and r["loss"] == ahead[r["step"]]["loss"], r["step"]
        assert r["skipped_steps"] == ahead[r["step"]]["skipped_steps"]
    assert list(losses(resumed)) == list(range(16, 31))


def test_periodic_evaluation_is_logged(run_dlaunch):
    proc, run_dir = run_dlaunch("trainer.steps=30", "trainer.eval_every=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in records(run_dir) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20, 30]  # the end's too: the curve's last point, and in summary.json
    assert evals[2]["eval_loss"] < evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert summary(run_dir)["metrics"]["eval_loss"] == evals[2]["eval_loss"]
    said = [line for line in proc.stderr.splitlines() if line.startswith("INFO eval at step")]  # on the terminal too
    assert said == [f"INFO eval at step {r['step']}: eval_loss={r['eval_loss']:.6g}" for r in evals[:2]]
    saved = ("trainer.steps=30", "trainer.eval_every=10", "trainer.checkpoint.every_steps=30")
    run_dlaunch(*saved, name="again")
    proc, again = run_dlaunch(*saved, name="again")  # a resume with nothing left to train: the end's record once
    assert proc.returncode == 0 and [r["step"] for r in records(again) if "eval_loss" in r] == [10, 20, 30]



def test_evaluations_are_not_counted_as_training_time(run_dlaunch):
    """examples/s measures training: a 2 s evaluation between two log points (a compiled model's evaluation
    compiles its own graph at first) made those steps read 2 s slower, and so the whole run's rate in summary.json."""
    proc, run_dir = run_dlaunch(f"recipe={FIXTURES / 'probe_recipe.py'}", "+recipe.eval_sleep=2", "trainer.steps=6",
                                "trainer.eval_every=2", "trainer.log_every=1", "cluster.device=cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    batch = summary(run_dir)["global_batch_size"]
    rates = {r["step"]: r["examples_per_sec"] for r in records(run_dir) if "examples_per_sec" in r}
    # steps 3 and 5 follow an evaluation: counted in, their window was over 2 s for one batch
    assert rates[3] > 4 * batch / 2 and rates[5] > 4 * batch / 2, rates
    assert summary(run_dir)["examples_per_sec"] > 4 * 5 * batch / (2 * 2)  # 5 steps after the first, 2 evaluations


def test_an_evaluation_on_rank_0_may_outlast_the_collective_timeout(run_dlaunch):
    """Under DDP rank 0 alone evaluates; the other ranks wait for it outside any collective. They used to go on to
    the next step's gradient all-reduce and time out there (gloo raises; nccl's watchdog kills the process), so an
    evaluation longer than launch.collective_timeout_s ended the run, at a periodic evaluation or at the end."""
    proc, run_dir = run_dlaunch(f"recipe={FIXTURES / 'probe_recipe.py'}", "+recipe.eval_sleep=7", "strategy=mirrored",
                                "cluster=1x2", "trainer.steps=4", "trainer.eval_every=2", "launch.collective_timeout_s=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in records(run_dir) if "eval_loss" in r] == [2, 4]
    # the waiting rank looks for rank 0's word without a store wait that times out: torch's client logged each one
    assert "likely a timeout" not in proc.stdout + proc.stderr + "".join(
        p.read_text() for p in (run_dir / "logs").rglob("*.log"))


def test_a_collective_in_an_evaluation_rank_0_does_alone_ends_the_run_at_once(run_dlaunch):
    """Under DDP rank 0 alone evaluates, and a collective in its evaluate has no partners: it used to wait out
    launch.collective_timeout_s (300 s by default) before the run failed. The waiting ranks see rank 0 in it."""
    proc, run_dir = run_dlaunch(f"recipe={FIXTURES / 'probe_recipe.py'}", "+recipe.eval_all_reduce=true",
                                "strategy=mirrored", "cluster=1x2", "trainer.steps=4", "trainer.eval_every=2",
                                "launch.collective_timeout_s=600", timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    text = " ".join(proc.stderr.replace("│", " ").split())
    lines = (FIXTURES / "probe_recipe.py").read_text().splitlines()
    line = next(i for i, source in enumerate(lines, 1) if "all_reduce(torch.zeros(1))" in source)  # evaluate's
    assert (f"rank 0 is in torch.distributed's all_reduce (at evaluate (probe_recipe.py:{line})) during its \"evaluation "
            "at step 2\", which it does alone while the other ranks wait for it outside any collective") in text, text
    assert "must not call collectives (docs/RECIPES.md)" in text and "timed out" not in text
    assert summary(run_dir)["status"] == "failed"


def test_rank_0s_checkpoint_commit_may_outlast_the_collective_timeout(run_dlaunch, tmp_path):
    """Rank 0 alone reads every rank's files back and commits the checkpoint (0.8 s per GiB): on a large model that
    outlasts launch.collective_timeout_s, and the other ranks, gone on to the next step's gradient all-reduce, were
    ended there. Here rank 0's commit of step 2 is held for 7 s against a 3 s timeout."""
    import threading
    import time

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "hold-save").write_text("2")

    def release() -> None:
        deadline = time.monotonic() + 240
        while not (run_dir / "saving").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(7)
        (run_dir / "hold-save").unlink()

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    proc, run_dir = run_dlaunch(f"recipe={FIXTURES / 'probe_recipe.py'}", "+recipe.hold_saves=true", "strategy=mirrored",
                                "cluster=1x2", "trainer.steps=4", "trainer.checkpoint.every_steps=2",
                                "launch.collective_timeout_s=3")
    releaser.join(timeout=5)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "saving").read_text() == "2" and summary(run_dir)["status"] == "completed"

def test_a_model_that_does_not_compile_is_named_with_torchs_reason(run_dlaunch):
    proc, run_dir = run_dlaunch(f"recipe.entry={FIXTURES / 'graph_break_recipe.py'}", "trainer.steps=3",
                                "trainer.compile.enabled=true", "trainer.compile.fullgraph=true")
    assert proc.returncode == 1
    text = " ".join(proc.stderr.replace("│", " ").split())
    assert "CompileError: torch.compile could not compile Printing" in text
    assert "graph_break_recipe.py:13 in forward: print(" in text  # the user's line
    assert "trainer.compile.fullgraph=true makes this graph break an error" in text
    assert summary(run_dir)["status"] == "failed"


@pytest.mark.parametrize("shape", [("strategy=one_device",), ("strategy=multi_worker_mirrored", "cluster=1x2")])
def test_a_step_that_forgets_return_loss_gets_one_paragraph_naming_its_file(run_dlaunch, shape):
    entry = FIXTURES / "no_loss_recipe.py"
    proc, run_dir = run_dlaunch(f"recipe.entry={entry}", "trainer.steps=3", *shape)
    assert proc.returncode == 1
    text = " ".join(proc.stderr.replace("│", " ").split())
    assert f"StepError: the recipe's train_step() ({entry}:10) returned None (did it forget `return loss`?)" in text
    assert text.count("(did it forget `return loss`?); it must") == 1 and "Traceback" not in text, proc.stderr[-3000:]
    assert summary(run_dir)["status"] == "failed" and 0 <= summary(run_dir)["wall_seconds"] < 300  # from the start to the failure


def test_compiled_training_runs_on_the_cpu(run_dlaunch):
    proc, run_dir = run_dlaunch("trainer.steps=30", "trainer.compile.enabled=true", "strategy=mirrored", "cluster=1x2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch.compile (mode default)" in proc.stdout + proc.stderr
    assert summary(run_dir)["final_loss"] < summary(run_dir)["first_loss"]


BROKEN = {
    # what the recipe gets wrong: (the text replaced in linear.py, its replacement, what dlaunch says)
    "build returns a tuple": (
        "    return Parts(model=model, optimizer=cfg.optimizer.build(model.parameters()), train_data=train_data, eval_data=eval_data)",
        "    return model, cfg.optimizer.build(model.parameters()), train_data",
        "RecipeContractError: the recipe's build() ({path}:{build}) returned a tuple; it must return "
        "launcher.runtime.recipe.Parts(model=..., optimizer=..., train_data=...)"),
    "evaluate returns a float": (
        '    return {"eval_loss": torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).item()}',
        "    return torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).item()",
        "RecipeContractError: the recipe's evaluate() ({path}:{evaluate}) returned a float; it must return a dict of names to numbers"),
    "evaluate returns a number as a string": (  # float("0.27") accepted it, and logged it: a bug of the recipe's
        '    return {"eval_loss": torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).item()}',
        '    return {"eval_loss": str(torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).item())}',
        "RecipeContractError: the recipe's evaluate() ({path}:{evaluate}) returned a str for 'eval_loss'; each value "
        "must be a number"),
    "the loss is NaN": (
        "    return torch.nn.functional.mse_loss(model(x), y)",
        "    return torch.nn.functional.mse_loss(model(x), y) * float('nan')",
        "LossNotFinite: loss is nan at step 1; lower recipe.optimizer.lr or check the data"),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_recipe_that_breaks_its_contract_gets_one_paragraph_naming_its_file(run_dlaunch, tmp_path, broken):
    old, new, said = BROKEN[broken]
    source = (FIXTURES.parent.parent / "recipes" / "linear.py").read_text()
    assert old in source
    path = tmp_path / "mine.py"
    path.write_text(source.replace(old, new))
    proc, run_dir = run_dlaunch(f"recipe={path}", "trainer.steps=3")
    assert proc.returncode == 1
    text = " ".join(proc.stderr.replace("│", " ").split())
    lines = path.read_text().splitlines()  # where each function starts: the line the message names
    said = said.format(path=path, **{n: next(i for i, t in enumerate(lines, 1) if t.startswith(f"def {n}(")) for n in ("build", "evaluate")})
    assert said in text, proc.stderr[-3000:]
    assert text.count(said.split(": ", 1)[1][:60]) == 1 and "Traceback" not in text, proc.stderr[-3000:]
    assert summary(run_dir)["status"] == "failed"


def test_a_parameter_server_plan_names_a_build_that_returns_no_parts(run_dlaunch, tmp_path):
    """Under parameter_server the launcher runs build() for the plan's variable table: the same paragraph, exit 1."""
    root = FIXTURES.parent.parent / "recipes"
    old = "    return Parts(model=model, optimizer=cfg.optimizer.build(model.parameters()), train_data=train_data, eval_data=eval_data)"
    source = (root / "wide_deep.py").read_text()
    assert old in source
    (tmp_path / "wd.py").write_text(source.replace(old, "    return model, train_data"))
    (tmp_path / "wd.yaml").write_text((root / "wide_deep.yaml").read_text())
    proc, _ = run_dlaunch(f"recipe={tmp_path / 'wd.py'}", "strategy=parameter_server", "cluster.workers=1", "cluster.ps=1",
                          "trainer.steps=3")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"the recipe's build() ({tmp_path / 'wd.py'}:" in proc.stderr and "returned a tuple" in proc.stderr


def test_a_nan_between_log_lines_is_caught_before_the_checkpoint_that_would_keep_it(run_dlaunch):
    """Logged every 10 steps, saved every 5, NaN at step 3: step 5's save stops the run; no checkpoint holds NaN."""
    from launcher.checkpoint import layout

    proc, run_dir = run_dlaunch(f"recipe={FIXTURES / 'probe_recipe.py'}", "+recipe.nan_step=3", "strategy=mirrored", "cluster=1x2",
                                "trainer.steps=20", "trainer.log_every=10", "trainer.checkpoint.every_steps=5")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "loss is nan at step 5, before its checkpoint (not saved)" in proc.stderr
    assert layout.latest(run_dir / "checkpoints") is None


def test_parameters_an_overflow_made_inf_are_never_saved_and_retention_keeps_the_good_checkpoint(run_dlaunch):
    """Step 5's loss was finite, its gradients inf: the update made the parameters NaN. Step 5's checkpoint held them,
    retention (keep=1) pruned step 4's, and every resume failed at step 6 again."""
    from launcher.checkpoint import layout

    proc, run_dir = run_dlaunch(f"recipe={FIXTURES / 'probe_recipe.py'}", "+recipe.overflow_step=5", "trainer.steps=8",
                                "trainer.log_every=10", "trainer.checkpoint.every_steps=1", "trainer.checkpoint.keep=1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    text = " ".join(proc.stderr.split())
    assert "ParametersNotFinite: parameters are inf/NaN after step 5, before its checkpoint (not saved)" in text, text[-3000:]
    assert layout.step_of(layout.latest(run_dir / "checkpoints")) == 4
    assert summary(run_dir)["last_completed_step"] == 4  # the last step known finite: its save checked it


def test_a_logged_step_whose_gradients_overflowed_ends_the_run_there(run_dlaunch):
    proc, run_dir = run_dlaunch(f"recipe={FIXTURES / 'probe_recipe.py'}", "+recipe.overflow_step=3", "trainer.steps=8",
                                "trainer.log_every=1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    text = " ".join(proc.stderr.split())
    assert "LossNotFinite: grad_norm is nan at step 3, whose loss (" in text, text[-3000:]
    assert "last completed step 2" in text and records(run_dir)[-1]["step"] == 3


def test_a_run_saved_under_a_schedule_and_resumed_without_one_trains_at_the_constant_lr(run_dlaunch):
    """The decayed lr (0 at the end of a linear decay) was kept: the resumed run trained at lr 0, silently."""
    common = ("recipe=linear", "trainer.log_every=10", "trainer.checkpoint.every_steps=20")
    run_ok(run_dlaunch, "run", *common, "trainer.steps=20", "trainer.lr_schedule.decay=linear")
    proc, run_dir = run_ok(run_dlaunch, "run", *common, "trainer.steps=40")
    assert "trainer.lr_schedule.decay: linear -> constant" in proc.stdout + proc.stderr
    lrs = {r["step"]: r["lr"] for r in records(run_dir) if "lr" in r}
    assert lrs[20] < 0.01 and lrs[30] == lrs[40] == lrs[1], lrs


def test_a_resume_trains_with_this_commands_lr_and_can_add_a_schedule(run_dlaunch):
    """The plan said `changed recipe.optimizer.lr: 0.05 -> 0.01`, but the saved lr (0.05) was trained with; and a
    schedule added on resume failed to load (its optimizer's initial_lr is not in a checkpoint saved without one)."""
    from launcher.config.trainer import ScheduleSpec
    from launcher.runtime.schedule import ScheduleFactor

    common = ("recipe=linear", "trainer.log_every=5", "trainer.checkpoint.every_steps=10")
    run_ok(run_dlaunch, "run", *common, "trainer.steps=10")
    proc, run_dir = run_ok(run_dlaunch, "run", *common, "trainer.steps=20", "recipe.optimizer.lr=0.01")
    assert "recipe.optimizer.lr: 0.05 -> 0.01" in proc.stdout + proc.stderr
    lrs = {r["step"]: r["lr"] for r in records(run_dir) if "lr" in r}
    assert lrs[10] == 0.05 and lrs[15] == lrs[20] == 0.01, lrs
    proc, run_dir = run_ok(run_dlaunch, "run", *common, "trainer.steps=40", "recipe.optimizer.lr=0.01",
                           "trainer.lr_schedule.decay=cosine")
    lrs = {r["step"]: r["lr"] for r in records(run_dir) if "lr" in r}
    factor = ScheduleFactor(ScheduleSpec(decay="cosine"), 40)
    # the schedule runs from the resumed step's position: step 21 trains at its lr for position 20
    assert lrs[25] == pytest.approx(0.01 * factor(24)) and lrs[40] == pytest.approx(0.01 * factor(39)), lrs


def test_a_diverged_steps_record_is_in_metrics_jsonl_with_its_lr_and_grad_norm(run_dlaunch):
    """The step whose loss was inf ended the run with no record of its own: the report's curves stopped a step early,
    without the grad_norm spike that says why."""
    import json

    proc, run_dir = run_dlaunch("recipe.optimizer.lr=1e6", "trainer.log_every=1", "trainer.steps=30")
    assert proc.returncode == 1 and "LossNotFinite: loss is" in proc.stderr, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = int(proc.stderr.split("LossNotFinite: loss is ")[1].split(" at step ")[1].split()[0].rstrip(";"))
    assert records[-1]["step"] == step and records[-1]["loss"] is None and records[-1]["lr"] == 1e6, records[-1]
    assert summary(run_dir)["last_logged_step"] == step and summary(run_dir)["last_logged_loss_step"] < step
    # the diverged step is logged, not completed: the last completed step is the last one known to be finite
    assert summary(run_dir)["last_completed_step"] == step - 1 and f"last completed step {step - 1}" in proc.stderr
