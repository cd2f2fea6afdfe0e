"""Script mode: ``dlaunch script=PATH ... -- ARGS`` runs an unmodified torch script on the planned cluster."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

import pytest

from tests.conftest import FIXTURES, ROOT, dlaunch, summary

LOOP = FIXTURES / "custom_loop.py"
SHAPES = {
    "one_device": ("strategy=one_device", "cluster=1x1"),
    "mirrored": ("strategy=mirrored", "cluster=1x2"),
    "multi_worker_mirrored": ("strategy=multi_worker_mirrored", "cluster=2x1"),  # 2 nodes emulated on this machine
}


def _run(tmp_path, *overrides: str, script_args: tuple[str, ...] = ()):
    """dlaunch OVERRIDES -- SCRIPT_ARGS; conftest's dlaunch() adds cluster.device=cpu before the ``--``."""
    run_dir = tmp_path / "run"
    proc = dlaunch(*overrides, f"hydra.run.dir={run_dir}", *(("--", *script_args) if script_args else ()), cwd=tmp_path)
    return proc, run_dir


def _losses(text: str) -> list[float]:
    """Rank 0's epoch losses (the other ranks' lines are tagged [rankN])."""
    return [float(v) for v in re.findall(r"^epoch \d+: loss ([\d.]+)$", text, re.M)]


@pytest.mark.parametrize("name", SHAPES)
def test_the_documented_loop_runs_under_each_strategy(name, tmp_path):
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc, run_dir = _run(tmp_path, "script=custom_loop.py", *SHAPES[name], script_args=("--epochs", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    replicas = 1 if name == "one_device" else 2
    assert f": {replicas} replica(s) in sync" in proc.stdout
    assert (run_dir / "config.yaml").read_text().startswith("# A script's run: `script` ran in place of a recipe")
    losses = _losses(proc.stdout)
    # The same global batches in the same order: the mean loss is one device's, whatever the strategy.
    assert losses == pytest.approx([2.724006, 0.101431], abs=2e-6)
    done = summary(run_dir)
    assert (done["status"], done["strategy"], done["num_replicas_in_sync"]) == ("completed", name, replicas)
    assert done["script"] == "custom_loop.py --epochs 2"
    assert f"results: {run_dir} (config.yaml, summary.json)" in " ".join(proc.stdout.split())  # a script writes no metrics.jsonl
    if name == "mirrored":  # dlaunch report: the summary, and why there is no loss chart
        shown = dlaunch("report", str(run_dir), cwd=tmp_path, device=None)
        assert shown.returncode == 0 and shown.stdout.split() == [str(run_dir / "report.html")], shown.stderr
        page = (run_dir / "report.html").read_text()
        assert "custom_loop.py --epochs 2" in page and "a script reports its own" in page


def test_the_docs_show_the_loop_that_the_test_runs():
    page = (ROOT / "docs" / "SCRIPTS.md").read_text()
    assert LOOP.read_text().strip() in page


def test_a_missing_script_is_a_config_error(run_dlaunch, tmp_path):
    proc, _ = run_dlaunch("script=nope/train.py")
    assert proc.returncode == 2
    assert "script.path" in proc.stdout + proc.stderr and str(tmp_path / "nope" / "train.py") in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_arguments_after_the_separator_need_a_script(tmp_path):
    proc, _ = _run(tmp_path, script_args=("--epochs", "2"))
    assert proc.returncode == 2
    assert "no script was given" in proc.stdout + proc.stderr and "--epochs 2" in proc.stdout + proc.stderr


def test_the_script_section_set_key_by_key_as_config_md_lists_it(tmp_path):
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc, _ = _run(tmp_path, "script.path=custom_loop.py", "script.args=[--epochs,2]", "launch.dry_run=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "custom_loop.py --epochs 2 (as __main__" in proc.stdout


def test_a_script_that_raises_shows_its_own_frame_once(run_dlaunch, tmp_path):
    (tmp_path / "broken.py").write_text("import torch\n\n\ndef build():\n    raise ValueError('bad shape 3x4')\n\n\nbuild()\n")
    proc, run_dir = run_dlaunch("script=broken.py", "strategy=mirrored", "cluster=1x2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") == 1  # rank 1 failed alike: one line for it under the panel
    assert proc.stderr.count('broken.py", line 5, in build') == 1
    assert "runpy" not in proc.stdout + proc.stderr and "launcher/runtime" not in proc.stdout + proc.stderr
    failed = summary(run_dir)  # a script's, as a completed script's: no dlaunch loop, so no steps or losses
    assert (failed["status"], failed["script"]) == ("failed", "broken.py") and not {"steps", "final_loss"} & failed.keys()


def test_an_argument_the_script_rejects_is_reported_once(tmp_path):
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc, _ = _run(tmp_path, "script=custom_loop.py", "strategy=mirrored", "cluster=1x2", script_args=("--epochz", "2"))
    assert proc.returncode == 2, proc.stderr[-3000:]  # argparse's code, as under python
    assert proc.stderr.count("unrecognized arguments: --epochz 2") == 1
    assert "exited with 2 (sys.exit)" in proc.stdout + proc.stderr


@pytest.mark.parametrize("code, status", [("3", 3), ("'no data found'", 1), ("130", 1)])
def test_dlaunch_exits_with_the_scripts_own_exit_code_as_python_does(run_dlaunch, tmp_path, code, status):
    (tmp_path / "stops.py").write_text(f"import sys\n\nsys.exit({code})\n")
    proc, _ = run_dlaunch("script=stops.py")
    assert proc.returncode == status, proc.stderr[-3000:]
    assert f"stops.py exited with {code}" in proc.stdout + proc.stderr
    assert "above" not in proc.stdout + proc.stderr or code.isdigit()  # a message is shown here, not "above"
    assert "its own message is above" not in proc.stdout + proc.stderr  # it printed nothing


@pytest.mark.parametrize("ps", [1, 0])
def test_parameter_server_is_refused_for_a_script(run_dlaunch, tmp_path, ps):
    """Without cluster.ps the screen also asked for cluster.ps=1, a fix that would have fixed nothing."""
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc, _ = run_dlaunch("script=custom_loop.py", "strategy=parameter_server", f"cluster.ps={ps}")
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "a script runs only in the training processes" in out and "(1 problem)" in out, out[-3000:]


def test_profiling_a_script_is_refused_naming_the_key(run_dlaunch, tmp_path):
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc, _ = run_dlaunch("script=custom_loop.py", "trainer.profile.enabled=true")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "trainer.profile.enabled = true" in proc.stderr and "a script runs its own" in proc.stderr


def test_the_plan_shows_the_script_and_not_the_loop(tmp_path):
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    # 3 replicas and the default global batch 64 would not divide: a script batches its own data.
    proc, _ = _run(tmp_path, "script=custom_loop.py", "strategy=mirrored", "cluster=1x3", "launch.dry_run=true",
                   script_args=("--lr", "0.1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = proc.stdout + proc.stderr
    assert "custom_loop.py --lr 0.1" in plan and "3 in sync" in plan
    assert not re.search(r"^\s*(batch|steps|checkpoints)\s", plan, re.M)


COUNTER = """import os, pathlib
with open(pathlib.Path(__file__).with_name("ran.txt"), "a") as f:
    f.write(os.environ.get("RANK", "parent") + "\\n")
"""


@pytest.mark.parametrize("strategy", ["fsdp", "mesh"])
def test_only_the_workers_run_the_script_the_plan_does_not(strategy, tmp_path):
    """fsdp's plan sizes a recipe's model on the meta device: it imported a script as if it were a recipe, in the
    parent, dry run included (its argparse then read dlaunch's own command line)."""
    (tmp_path / "count.py").write_text(COUNTER)
    extra = ("strategy.data_parallel=fsdp",) if strategy == "mesh" else ()
    dry, _ = _run(tmp_path, "script=count.py", f"strategy={strategy}", *extra, "cluster=1x2", "launch.dry_run=true")
    assert dry.returncode == 0 and not (tmp_path / "ran.txt").exists(), dry.stderr[-3000:]
    if strategy == "fsdp":
        proc, _ = _run(tmp_path, "script=count.py", "strategy=fsdp", "cluster=1x2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted((tmp_path / "ran.txt").read_text().split()) == ["0", "1"]
        # it never called strategy.prepare, but it trained no model either (no optimizer step): nothing to say
        assert "never called strategy.prepare" not in proc.stderr, proc.stderr[-3000:]


PREPARED = """import torch
from launcher import distribute as dl
strategy = dl.get_strategy()
with strategy.scope():
    model = torch.nn.Linear(8, 1)
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
print("sharded:", type(next(model.parameters())).__name__)
"""


def test_a_script_that_prepares_its_model_under_fsdp_is_sharded_and_not_warned(tmp_path):
    (tmp_path / "prepared.py").write_text(PREPARED)
    proc, _ = _run(tmp_path, "script=prepared.py", "strategy=fsdp", "cluster=1x2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sharded: DTensor" in proc.stdout and "never called strategy.prepare" not in proc.stderr, proc.stderr[-3000:]


STOPPABLE = """import os, pathlib, sys, time
out, rank = pathlib.Path(sys.argv[1]), os.environ.get('RANK', '0')
(out / f"rank{rank}").touch()
try:
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:  # as under python and torchrun: a script's own last words on Ctrl-C
    (out / f"interrupted{rank}").touch()
    raise
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_stops_every_script_process_and_ctrl_c_is_a_keyboard_interrupt_there(signum, code, tmp_path):
    from tests.launch.test_restarts import STARTUP_S, finish, run_processes, start, wait_for

    (tmp_path / "stoppable.py").write_text(STOPPABLE)
    run_dir = tmp_path / "run"
    proc = start(run_dir, f"script={tmp_path / 'stoppable.py'}", "strategy=mirrored", "cluster=1x2", "--",
                 str(tmp_path), common=())  # the probe recipe's trainer keys: a script is refused them
    try:
        wait_for(lambda: (tmp_path / "rank0").exists() and (tmp_path / "rank1").exists(), STARTUP_S, "both ranks in the script")
        proc.send_signal(signum)
        wait_for(lambda: not run_processes(run_dir) and proc.poll() is not None, 30, "every process to end (no orphans)")
    finally:
        out = finish(proc, timeout=30)
    assert proc.returncode == code, out[-3000:]
    assert [(tmp_path / f"interrupted{r}").exists() for r in (0, 1)] == [signum == signal.SIGINT] * 2, out[-3000:]
    # each rank says where the signal found its script (its loop), in its own line and in the run's report
    assert f"stopped by {signal.Signals(signum).name} in <module> (stoppable.py:" in out, out[-3000:]
    assert "; a script saves its own checkpoints" in out
    assert "runs it again with the same arguments" in " ".join(out.split()) and "trainer.checkpoint.every_steps" not in out


@pytest.mark.parametrize("processes", [1, 2])
def test_a_torchrun_script_runs_unmodified_and_trains_as_under_torchrun(processes, tmp_path):
    """Its own init_process_group() joins dlaunch's group (2 processes) or makes a group of one from the variables
    torchrun would set (1 process); the losses are torchrun's own."""
    import subprocess
    import sys

    shutil.copy(FIXTURES / "torchrun_script.py", tmp_path / "train.py")
    shape = ("strategy=mirrored", "cluster=1x2") if processes == 2 else ()
    for _ in range(3 if processes == 2 else 1):  # its destroy_process_group() hung 1 run in 3 when it ended dlaunch's group
        proc, _ = _run(tmp_path, "script=train.py", *shape)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "never synced" not in proc.stdout + proc.stderr  # its own DDP syncs them
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                               "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    # torchrun itself ends 1 run in 6 with SIGABRT in gloo's teardown (torch 2.13 on CPU), after the script printed all
    # it prints, with or without a barrier first: the reference's losses stand. dlaunch survives that abort
    # (launch/report.py: a rank that aborts after completing does not fail the run), as the loop above checks.
    torch_teardown_abort = "terminate called without an active exception" in torchrun.stderr
    assert torchrun.returncode == 0 or torch_teardown_abort, torchrun.stderr[-3000:]
    lines = [line for line in torchrun.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2 and f"(world {processes}, local rank 0)" in lines[0]
    assert [line for line in proc.stdout.splitlines() if line.startswith("epoch")] == lines


def test_a_restarted_script_run_counts_its_restart(run_dlaunch, tmp_path):
    (tmp_path / "flaky.py").write_text(
        "import os\n\nimport torch.distributed as dist\n\n"
        "if dist.get_rank() == 1 and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    raise RuntimeError('the first attempt fails')\n"
        "dist.barrier()\n")
    proc, run_dir = run_dlaunch("script=flaky.py", "strategy=mirrored", "cluster=1x2", "launch.max_restarts=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = summary(run_dir)
    assert (done["status"], done["restarts"], done["history"]["restarts"]) == ("completed", 1, 1)


CHIEF = FIXTURES / "chief_metrics.py"


@pytest.mark.parametrize("name", ["one_device", "mirrored"])
def test_only_the_chief_writes_metrics_into_dlaunch_run_dir_and_the_report_charts_them(name, tmp_path):
    """DLAUNCH_RUN_DIR in every process; ``strategy.extended.should_save_summary`` (SCRIPTS.md's
    accelerator.is_main_process) is true in one process of each run: one_device has no process group."""
    shutil.copy(CHIEF, tmp_path / "chief_metrics.py")
    proc, run_dir = _run(tmp_path, "script=chief_metrics.py", *SHAPES[name], script_args=("--steps", "4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"run directory: {run_dir.resolve()}; chief: True" in proc.stdout
    others = "".join(p.read_text() for p in (run_dir / "logs").rglob("stdout.log")) if name == "mirrored" else ""
    assert others.count(f"run directory: {run_dir.resolve()}; chief: False") == (1 if name == "mirrored" else 0)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["loss"] < records[0]["loss"]  # one writer
    shown = dlaunch("report", str(run_dir), cwd=tmp_path, device=None)
    assert shown.returncode == 0 and (run_dir / "loss.png").exists(), shown.stderr
    done = summary(run_dir)  # a sweep's table and objective read a script's last loss as a recipe run's
    assert (done["final_loss"], done["last_logged_step"]) == (records[-1]["loss"], 4)
    if name == "one_device":  # a second command in the directory keeps the script's own file, and its summary reads on
        again = dlaunch("resume", str(run_dir), "--", "--steps", "6", cwd=tmp_path, device=None)
        assert again.returncode == 0, again.stderr[-3000:]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3, 4, 1, 2, 3, 4, 5, 6]  # the script starts afresh: no checkpoint
        done = summary(run_dir)
        assert (done["final_loss"], done["last_logged_step"], done["history"]) == \
            (records[-1]["loss"], 6, {"commands": 2, "restarts": 0, "resumes": 0})


def test_the_docs_show_the_chief_script_that_the_test_runs():
    assert CHIEF.read_text().strip() in (ROOT / "docs" / "SCRIPTS.md").read_text()


OWN_LOOP = FIXTURES / "own_loop.py"


def _steps(text: str) -> list[tuple[float, float]]:
    """Rank 0's (loss, grad_norm) per step of own_loop.py (grad_norm inf: a step fp16's GradScaler skipped)."""
    return [(float(a), float(b)) for a, b in re.findall(r"^step \d+: loss ([\d.]+) grad_norm ([\d.]+|inf)$", text, re.M)]


@pytest.mark.parametrize("precision, dtype, tolerance", [("fp32", "float32", 1e-5), ("bf16-mixed", "bfloat16", 2e-2),
                                                          ("fp16-mixed", "float16", None)])
def test_a_script_takes_precision_accumulation_and_clipping_from_the_strategy(precision, dtype, tolerance, tmp_path):
    """Two DDP processes, 2 micro-batches each (one sync), clipped at 2.0, in trainer.precision: the steps of plain
    ``python own_loop.py`` on one device in fp32 with the whole batch and the same clip. A clip of each rank's own
    gradients, or a sync per micro-batch that dropped one, would not be. fp16's GradScaler skips its first update (its
    first scale overflows), as in any fp16 loop, and then trains."""
    import subprocess
    import sys

    shutil.copy(OWN_LOOP, tmp_path / "own_loop.py")
    plain = subprocess.run([sys.executable, "own_loop.py", "--clip", "2.0"], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert plain.returncode == 0 and "precision: fp32" in plain.stdout, plain.stderr[-3000:]
    proc, run_dir = _run(tmp_path, "script=own_loop.py", *SHAPES["mirrored"], f"trainer.precision={precision}",
                         script_args=("--accum", "2", "--clip", "2.0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"precision: {precision}" in proc.stdout and f"forward in torch.{dtype}" in proc.stdout
    reference, steps = _steps(plain.stdout), _steps(proc.stdout)
    assert len(steps) == len(reference) == 6 and sum(norm > 2.0 for _, norm in reference) >= 3  # clipped steps
    assert reference[-1][0] < 0.5 * reference[0][0]
    if precision == "fp16-mixed":  # GradScaler's first scale (2**16) overflows here: that update is skipped
        assert steps[0][1] == float("inf") and all(norm < float("inf") for _, norm in steps[1:])
        assert steps[-1][0] < 0.6 * steps[0][0]
    else:
        assert steps == [pytest.approx(step, rel=tolerance) for step in reference]
    assert summary(run_dir)["precision"] == precision and summary(run_dir).get("autocast_entered") is not False
    assert "has not called" not in proc.stdout + proc.stderr and "has not entered" not in proc.stdout + proc.stderr


def test_a_script_given_a_precision_it_never_asks_for_is_told(tmp_path):
    """custom_loop.py enters no strategy.autocast(): bf16-mixed would have changed nothing, silently."""
    shutil.copy(LOOP, tmp_path / "custom_loop.py")
    proc, run_dir = _run(tmp_path, "script=custom_loop.py", "trainer.precision=bf16-mixed", script_args=("--epochs", "1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(run_dir)["precision"] == "bf16-mixed"  # as asked, and whether the script used it: runs compared
    assert summary(run_dir)["autocast_entered"] is False  # by their summaries should not read this one as bf16
    said = " ".join((proc.stdout + proc.stderr).split())
    told = ("trainer.precision=bf16-mixed: after its first optimizer step, the script has not entered "
            "strategy.autocast(), so unless it enters torch.autocast itself, its forward pass runs without autocast")
    assert said.count(told) == 1 and said.count("has not entered") == 1, said[-3000:]  # as it trains, not at the end
    assert "grad_scaler" not in said


def test_the_docs_show_the_own_loop_that_the_test_runs():
    assert OWN_LOOP.read_text().strip() in (ROOT / "docs" / "SCRIPTS.md").read_text()


PARTIAL = """import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from launcher import distribute as dl

weighted = sys.argv[1:] == ["--weighted"]
strategy = dl.get_strategy()
torch.manual_seed(0)
with strategy.scope():
    model = strategy.prepare(torch.nn.Linear(4, 1))
x = torch.randn(100, 4)
data = strategy.experimental_distribute_dataset(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32))


def fn(batch):
    inputs, targets = batch
    if weighted:
        per_example = F.mse_loss(model(inputs), targets, reduction="none").squeeze(1)
        return dl.compute_average_loss(per_example, global_batch_size=32).detach()
    return F.mse_loss(model(inputs), targets).detach()


for batch in data:
    loss = strategy.reduce(dl.ReduceOp.SUM if weighted else dl.ReduceOp.MEAN, strategy.run(fn, args=(batch,)), axis=None)
    print("loss", loss.item(), flush=True)
"""


@pytest.mark.parametrize("weighted", [False, True])
def test_a_last_partial_batch_that_leaves_a_replica_no_rows_is_said_once_with_the_fix(weighted, tmp_path):
    """100 rows in batches of 32 on 2 replicas: the last 4 go to replica 0, as TF rebatches; replica 1's mean is
    NaN. The script weights its own loss, so rank 0 says so once; compute_average_loss over the global batch is
    finite (a replica with no rows adds 0)."""
    (tmp_path / "partial.py").write_text(PARTIAL)
    proc, _ = _run(tmp_path, "script=partial.py", "strategy=mirrored", "cluster=1x2",
                   script_args=("--weighted",) if weighted else ())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("splits over the 2 replicas as [4, 0]") == 1, out[-3000:]
    assert "replica 1 gets no rows" in out and "global_batch_size=32" in out and "drop_last=True" in out
    losses = [float(v) for v in re.findall(r"^loss (\S+)$", proc.stdout, re.M)]
    assert len(losses) == 4 and all(v == v for v in losses) == weighted  # NaN != NaN: the plain mean's last loss
