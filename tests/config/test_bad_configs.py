"""Bad configs: exit 2, one screen, the key and the bad value named, no traceback.

In-process through ``launcher.cli.main.main`` (fast), plus a few real processes
for the exit code a shell sees.
"""

from __future__ import annotations

import pytest

from launcher.cli import job as cli_job
from launcher.cli.main import main
from tests.conftest import FIXTURES, dlaunch

# (overrides, key the message must name, text that must appear)
CASES = [
    (["strategy=mirored"], "strategy", "did you mean mirrored"),
    (["strategy=centre"], "strategy", "allowed: central_storage, fsdp, mesh, mirrored, multi_worker_mirrored, one_device, parameter_server"),
    (["recipe=lnear"], "recipe", "did you mean linear"),
    (["cluster=2x"], "cluster", "NxM"),
    (["cluster=0x2"], "cluster", "both >= 1"),
    (["cluster=axb"], "cluster", "NxM"),
    (["trainer.stpes=5"], "trainer.stpes", "did you mean trainer.steps"),
    (["trainr.steps=5"], "trainr.steps", "did you mean trainer.steps"),
    (["+trainer.warmup_steps=5"], "trainer.warmup_steps", "did you mean trainer.lr_schedule.warmup_steps"),
    (["trainer.warmup_steps=5"], "trainer.warmup_steps", "did you mean trainer.lr_schedule.warmup_steps"),
    (["+trainer.foo=1"], "trainer.foo", "unknown key"),
    # other tools' habits: the same name elsewhere beats a sibling that merely begins with it (lr_schedule)
    (["trainer.lr=0.1"], "trainer.lr", "did you mean recipe.optimizer.lr?"),
    (["lr=0.1"], "lr", "did you mean recipe.optimizer.lr?"),
    (["optimizer.lr=0.1"], "optimizer.lr", "did you mean recipe.optimizer.lr?"),
    (["steps=10"], "steps", "did you mean trainer.steps?"),
    (["trainer.global_batch_size=64"], "trainer.global_batch_size", "did you mean input.global_batch_size?"),
    (["trainer.batch_size=8"], "trainer.batch_size", "did you mean input.global_batch_size?"),
    (["max_steps=100"], "max_steps", "did you mean trainer.steps?"),
    (["trainer.step=3"], "trainer.step", "did you mean trainer.steps?"),
    (["recipe.optimizr.lr=0.1"], "recipe.optimizr.lr", "did you mean recipe.optimizer.lr"),
    (["+recipe.optimizer.nesterov=1"], "recipe.optimizer.nesterov", "unknown key"),
    # how each step trains (issue 15)
    (["trainer.precision=fp8"], "trainer.precision", "allowed: fp32, bf16-mixed, fp16-mixed"),
    (["strategy=parameter_server", "recipe=wide_deep", "cluster.ps=1", "trainer.precision=fp16-mixed"],
     "trainer.precision", "the ps tasks apply the gradients, so GradScaler can neither unscale them"),
    (["strategy=central_storage", "trainer.compile.enabled=true"], "trainer.compile.enabled", "threads of one process"),
    (["strategy=central_storage", "strategy.compute_devices=[cpu:0,cpu:1]", "trainer.activation_checkpointing=[Linear]"],
     "trainer.activation_checkpointing", "its 2+ replicas are threads of one process that share the CPU's random generator"),
    (["strategy=parameter_server", "recipe=wide_deep", "cluster.ps=1", "trainer.activation_checkpointing=[Linear]"],
     "trainer.activation_checkpointing", "a forward recomputed in backward would find only meta tensors"),
    (["trainer.activation_checkpointing=[Linear,Linear]"], "trainer.activation_checkpointing", "names a module class twice"),
    (["trainer.activation_checkpointing=['']"], "trainer.activation_checkpointing.0", "at least 1 character"),
    (["strategy=mirrored", "cluster=1x2", "trainer.grad_accum_steps=3"], "trainer.grad_accum_steps",
     "global batch 64 = 2 replica(s) x 32 per replica, and 32 does not split into 3 equal micro-batches"),
    (["trainer.steps=10", "trainer.lr_schedule.decay=cosine", "trainer.lr_schedule.warmup_steps=4",
      "trainer.lr_schedule.decay_steps=8"], "trainer.lr_schedule.decay_steps", "= 12 is longer than trainer.steps=10"),
    (["trainer.steps=10", "trainer.lr_schedule.warmup_steps=11"], "trainer.lr_schedule.warmup_steps",
     "warm-up of 11 steps is longer than trainer.steps=10"),
    # settings that would change nothing: refused, as decay_steps without a decay is
    (["trainer.lr_schedule.decay_steps=5"], "trainer.lr_schedule.decay_steps", "decay_steps needs decay=cosine or decay=linear"),
    (["trainer.lr_schedule.min_lr_ratio=0.5"], "trainer.lr_schedule.min_lr_ratio", "min_lr_ratio needs decay=cosine or decay=linear"),
    (["trainer.lr_schedule.warmup_start=0.5"], "trainer.lr_schedule.warmup_start", "warmup_start needs warmup_steps > 0"),
    (["trainer.steps=6", "trainer.lr_schedule.warmup_steps=6", "trainer.lr_schedule.decay=linear"],  # the decay never runs
     "trainer.lr_schedule.warmup_steps = 6", "warm-up of 6 steps = trainer.steps=6 leaves no step for decay=linear"),
    ([f"recipe.entry={FIXTURES / 'manual_recipe.py'}", "trainer.grad_accum_steps=2"], "trainer.grad_accum_steps",
     "does its own backward and update"),
    (["recipe=bench_mlp", "trainer.eval_every=10"], "trainer.eval_every", "recipe bench_mlp has no evaluate(model, parts)"),
    (["strategy=mesh", "recipe=tp_mlp", "cluster=1x2", "recipe.optimizer.implementation=fused"], "recipe.optimizer.implementation",
     "fused sgd cannot run under strategy mesh: the split layers' parameters are DTensors"),
    (["strategy=fsdp", "cluster=1x2", "strategy.init_from=rank0", "recipe.optimizer.name=adagrad"], "recipe.optimizer.name",
     "adagrad makes its state when it is built: strategy fsdp cannot run it here (with strategy.init_from=rank0"),
    (["trainer.checkpoint.dir=~/ck"], "trainer.checkpoint.dir=~/ck",  # Hydra reads ~ as a deletion: quoting parses
     "did you mean \"trainer.checkpoint.dir='~/ck'\"?"),
    (["recipe.optimizer.implementation=fast"], "recipe.optimizer.implementation", "for_loop, foreach, fused"),
    (["trainer.steps=-5"], "trainer.steps", "greater than 0"),
    # what Hydra types from the command line, and near misses of an allowed value
    ([f"recipe.entry={FIXTURES / 'probe_recipe.py'}", "+recipe.label=nan"], "recipe.label",
     "nan reads as a number; quote it to mean the text ('recipe.label=\"nan\"' on the command line"),
    ([f"recipe.entry={FIXTURES / 'probe_recipe.py'}", "+recipe.label=null"], "recipe.label", "null reads as no value"),
    (["trainer.precision=bf16"], "trainer.precision", "did you mean bf16-mixed?"),
    (["recipe.optimizer.name=SGD"], "recipe.optimizer.name", "did you mean sgd?"),
    # other tools' words for dlaunch's values
    (["cluster.device=gpu"], "cluster.device", "did you mean cuda?"),
    (["strategy=ddp"], "strategy", "did you mean mirrored?"),
    (["strategy=MirroredStrategy"], "strategy", "did you mean mirrored?"),  # tf.distribute's class names
    (["strategy=MultiWorkerMirroredStrategy"], "strategy", "did you mean multi_worker_mirrored?"),
    (["strategy=TPUStrategy"], "strategy", "did you mean mesh?"),
    (["trainer.precision=half"], "trainer.precision", "did you mean fp16-mixed?"),
    (["trainer.steps=0"], "trainer.steps", "greater than 0"),
    (["trainer.steps=abc"], "trainer.steps", "valid integer"),
    (["trainer.seed=-1"], "trainer.seed", "greater than or equal to 0"),
    (["trainer.log_every=0"], "trainer.log_every", "greater than 0"),
    (["input.global_batch_size=0"], "input.global_batch_size", "greater than 0"),
    (["input.global_batch_size=2.5"], "input.global_batch_size", "integer"),
    (["input.shuffle=maybe"], "input.shuffle", "valid boolean"),
    (["recipe.optimizer.lr=-1"], "recipe.optimizer.lr", "greater than 0"),
    (["recipe.optimizer.name=sgdd"], "recipe.optimizer.name", "did you mean sgd"),
    (["recipe.optimizer.momentum=1.5"], "recipe.optimizer.momentum", "less than 1"),
    (["recipe.features=0"], "recipe.features", "greater than 0"),
    (["cluster.device=gpu"], "cluster.device", "allowed: auto, cpu, cuda"),
    (["cluster.backend=mpi"], "cluster.backend", "allowed: auto, gloo, nccl"),
    (["cluster.master_port=70000"], "cluster.master_port", "less than or equal to 65535"),
    (["cluster.device=cuda"], "cluster.device", "no CUDA device"),
    (["strategy=mirrored", "cluster=1x3"], "input.global_batch_size", "not divisible by 3"),
    (["strategy=mirrored", "strategy.bucket_cap_mb=0"], "strategy.bucket_cap_mb", "greater than 0"),
    (["strategy=mirrored", "+strategy.device=cpu"], "strategy.device", "unknown key"),
    (["strategy=one_device", "cluster=1x4"], "cluster", "1 replica"),
    (["launch.monitor_interval_s=0"], "launch.monitor_interval_s", "greater than 0"),
    (["launch.dry_run=perhaps"], "launch.dry_run", "valid boolean"),
    (["recipe.entry=nosuch.module"], "recipe.entry", "cannot import"),
    (["recipe.entry=/nonexistent/recipe.py"], "recipe.entry", "does not exist"),
    (["recipe.entry=launcher.cli.plan"], "recipe.entry", "has no function build"),
    (["trainer.steps"], "trainer.steps", "cannot parse"),
    (["~strategy"], "strategy", "required key is missing"),
    (["hydra.run.dir="], "hydra.run.dir", "must name a directory"),
    (["trainer.steps=true"], "trainer.steps", "valid integer"),
    (["strategy.device=tpu:0"], "strategy.device", "unknown device"),
    (["strategy.device=cuda:0"], "strategy.device", "0 CUDA device"),
    (["strategy=mirrored", "strategy.bucket_cap_mb=inf"], "strategy.bucket_cap_mb", "finite"),
    (["recipe=wide_deep", "strategy=parameter_server", "cluster.ps=1", "cluster.workers=1", "input.drop_remainder=false"],
     "input.drop_remainder = false", "the tasks push their gradients unweighted by their rows"),  # as typed
    ([f"recipe.entry={FIXTURES / 'manual_recipe.py'}", "strategy=mirrored", "cluster=1x2", "input.drop_remainder=false"],
     "input.drop_remainder", "keep input.drop_remainder=true, or drop the optimizer argument"),
    (["strategy=mirrored", "strategy.cross_device_ops=hierarchical"], "strategy.cross_device_ops",
     "allowed: nccl_all_reduce, hierarchical_copy, reduction_to_one_device, shared_memory"),
    (["strategy=multi_worker_mirrored", "strategy.cross_device_ops=nccl_allreduce"], "strategy.cross_device_ops", "did you mean nccl_all_reduce"),
    (["strategy=one_device", "+strategy.cross_device_ops=hierarchical_copy"], "strategy.cross_device_ops", "unknown key"),
    (["strategy=parameter_server", "recipe=wide_deep"], "cluster.ps", "give cluster.ps=1 or more"),
    (["trainer.loggers=[wandb]"], "trainer.loggers.0", "allowed: tensorboard"),
    (["strategy=mesh", "recipe=tp_mlp", "cluster=1x2", "strategy.device_assignment.num_replicas=2"],
     "strategy.device_assignment.num_replicas", "computation_shape [1, 1, 1, 2] x num_replicas 2 = 4 devices, but cluster 1x2 has 2"),
    (["strategy=mesh", "recipe=tp_mlp", "cluster=1x3"], "strategy.device_assignment.computation_shape",
     "needs a multiple of 2 devices, but cluster 1x3 has 3"),
    (["strategy=mesh", "recipe=tp_mlp", "cluster=1x2", "strategy.data_parallel=fsdp", "strategy.device_assignment.num_replicas=2"],
     "strategy.device_assignment.num_replicas", "dp 2 x tp 2 = 4 devices, but cluster 1x2 has 2"),
    (["strategy=mesh", "recipe=tp_mlp", "cluster=1x4", "strategy.fsdp.wrap=[Linear]"], "strategy.fsdp",
     "with data_parallel=replicate nothing is sharded"),
    (["strategy=mesh", "recipe=tp_mlp", "strategy.data_parallel=zero"], "strategy.data_parallel", "allowed: replicate, fsdp"),
    (["strategy=mesh", "recipe=tp_mlp", "cluster=1x4", "strategy.device_assignment.computation_shape=[1,0,1,2]"],
     "strategy.device_assignment.computation_shape.1", "greater than 0"),
    (["strategy=mirrored", "cluster=1x2", "cluster.ps=2"], "cluster.ps", "only strategy=parameter_server has ps"),
    (["strategy=parameter_server", "recipe=wide_deep", "cluster.ps=1", "cluster=1x2"], "cluster", "not from cluster=1x2"),
    (["strategy=parameter_server", "recipe=wide_deep", "cluster=1x2"], "cluster.ps",  # both said at once, not in turn
     "give cluster.ps=1 or more (and cluster.workers=N for workers besides the chief); its tasks come from "
     "cluster.workers and cluster.ps, not from cluster=1x2: use cluster=1x1"),
    (["strategy=parameter_server", "recipe=wide_deep", "cluster.ps=1", "cluster.workers=6"], "input.global_batch_size",
     "cluster chief + 6 worker(s) (its 1 ps task(s) hold variables) = 7 replicas"),
    (["strategy=parameter_server", "recipe=wide_deep", "cluster.ps=1", "strategy.partitioner.kind=fixed"],
     "strategy.partitioner.num_shards", "needs num_shards"),
    (["strategy=parameter_server", "recipe=wide_deep", "cluster.ps=1", "trainer.lr_schedule.warmup_steps=2"],  # the key set
     "trainer.lr_schedule.warmup_steps = 2", "strategy parameter_server cannot do this: the ps tasks own the optimizer"),
    (["strategy=parameter_server", "recipe=wide_deep", "cluster.ps=1", "strategy.mode=eventually"], "strategy.mode",
     "allowed: async, sync"),
    (["strategy=parameter_server", "cluster.ps=1"], "strategy", "recipe linear declares strategies"),
    (["strategy=parameter_server", "recipe=wide_deep", "cluster=tasks",
      'cluster.tasks={chief: ["127.0.0.1:2222"], ps: ["127.0.0.1:2223"]}', "cluster.task={type: ps, index: 1}"],
     "cluster.task", "ps:1 is not in cluster.tasks (1 ps task(s))"),
    # numpy seeds its RNG from 0 to 2**32 - 1; a larger seed was a traceback from the workers
    (["trainer.seed=4294967296"], "trainer.seed", "less than or equal to 4294967295"),
    (["input.seed=99999999999999999999999"], "input.seed", "less than or equal to 4294967295"),
    # a value given for a section: the key that takes it, not pydantic's "valid dictionary or instance of ..."
    (["trainer.checkpoint=20"], "trainer.checkpoint", "did you mean trainer.checkpoint.every_steps=20?"),
    (["trainer.lr_schedule=cosine"], "trainer.lr_schedule", "did you mean trainer.lr_schedule.decay=cosine?"),
    (["recipe.optimizer=adamw"], "recipe.optimizer", "did you mean recipe.optimizer.name=adamw?"),
    (["trainer.loggers=tensorboard"], "trainer.loggers", "a list of one: trainer.loggers=[tensorboard]"),
    # a list of two: "a list of one" led to the next error ("at least 2 items")
    (["recipe.optimizer.betas=0.9"], "recipe.optimizer.betas", "give a list, e.g. recipe.optimizer.betas=[0.9,0.999] "
     "(its default; 2 items)"),
    (["recipe.optimizer.betas=[0.9]"], "recipe.optimizer.betas", "not 1; e.g. recipe.optimizer.betas=[0.9,0.999]"),
    # a read-ahead that never ends held the loop (and its stop signals) while it filled memory
    (["input.prefetch=1000000000"], "input.prefetch", "less than or equal to 32"),
    (["input.copy_stream=default"], "input.copy_stream", "allowed: compute, side"),
]


@pytest.mark.parametrize("overrides,key,text", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_config_exits_2_naming_the_key(overrides, key, text, capsys, monkeypatch):
    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)  # the cases mean a machine without a GPU
    assert main(overrides) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err
    assert key in err
    assert text in err
    assert "Traceback" not in err
    assert len(err.splitlines()) <= 25


def test_a_rule_over_a_recipes_keys_names_the_recipe_not_its_whole_section(capsys, monkeypatch):
    """A recipe Config's model_validator: the key line showed `recipe = {'strategies': [...], ...` cut short."""
    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)
    assert main(["recipe=charlm", "recipe.heads=3", "cluster.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "\n  recipe\n    d_model=64 does not split evenly among heads=3\n" in err and "{'strategies'" not in err, err


def test_a_sweep_is_checked_job_by_job(capsys):
    assert main(["-m", "strategy=one_device,mirored"]) == 2
    assert "did you mean mirrored" in capsys.readouterr().err


def test_an_unknown_group_option_does_not_hide_the_other_problems(capsys, monkeypatch):
    """The keys under a group whose option is unknown mean nothing and are left out; the others are all checked."""
    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)
    assert main(["strategy=mirored", "strategy.bucket_cap_mb=-5", "input.global_batch_size=0", "trainer.stepz=5"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration (3 problems)" in err and "did you mean mirrored" in err, err
    assert "input.global_batch_size = 0" in err and "trainer.stepz = 5" in err and "bucket_cap_mb" not in err
    # the rest is checked against the default strategy: its rules must not blame the cluster the user asked for
    assert main(["strategy=mirored", "cluster=1x2"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration (1 problem)" in err and "cluster = 1x2" not in err, err


def test_an_override_that_does_not_parse_or_resolve_does_not_hide_the_other_problems(capsys, monkeypatch):
    """Each override that does not parse is named, and left out of the check of the rest; so is each key whose
    interpolation fails (its default stands in), without the default's own problems."""
    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)
    assert main(["trainer.steps=[", "x=(", "trainer.stepz=3", "input.global_batch_size=0"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration (4 problems)" in err and err.count("cannot parse this override") == 2, err
    assert "trainer.stepz = 3" in err and "input.global_batch_size = 0" in err and "Traceback" not in err
    assert main(["trainer.steps=${nope}", "trainer.log_every=${oops}", "input.global_batch_size=0"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration (3 problems)" in err, err
    assert "Interpolation key 'nope' not found" in err and "Interpolation key 'oops' not found" in err
    assert "input.global_batch_size = 0" in err


def test_a_checkpoint_directory_that_cannot_be_made_is_named_beside_the_other_problems(capsys, monkeypatch, tmp_path):
    """The disk is asked with the schema, not after it passes: one attempt shows a typo and the directory."""
    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert main(["trainer.steps=abc", "trainer.checkpoint.every_steps=5", f"trainer.checkpoint.dir={a_file}/ckpt"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration (2 problems)" in err and "trainer.steps = abc" in err, err
    assert "trainer.checkpoint.dir = " in err and "is not a directory" in err
    # checkpoints off: the directory is never made, so it is no problem
    assert main(["trainer.steps=abc", f"trainer.checkpoint.dir={a_file}/ckpt"]) == 2
    assert "(1 problem)" in capsys.readouterr().err


def test_an_unknown_key_does_not_hide_the_other_problems_of_the_command(tmp_path):
    """The command line's pre-check names every mistake at once: an unknown key, a bad value, a recipe's unknown
    field and a rule, not only the unknown key that stopped Hydra's composition."""
    proc = dlaunch("recipe=linear", "trainer.stpes=5", "recipe.hiden=3", "recipe.optimizer.lr=abc",
                   "trainer.profile.wait=-2", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "invalid configuration (4 problems)" in proc.stderr
    for key in ("trainer.stpes = 5", "recipe.hiden = 3", "recipe.optimizer.lr = abc", "trainer.profile.wait = -2"):
        assert key in proc.stderr, proc.stderr


def test_every_trainer_feature_a_strategy_refuses_is_named_at_once(capsys, monkeypatch):
    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)
    assert main(["recipe=wide_deep", "strategy=parameter_server", "cluster.ps=1", "trainer.precision=fp16-mixed",
                 "trainer.compile.enabled=true", "trainer.clip_grad_norm=1.0", "trainer.lr_schedule.decay=cosine"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration (4 problems)" in err and err.count("strategy parameter_server cannot do this") == 4
    for key in ("trainer.precision = fp16-mixed", "trainer.compile.enabled = true", "trainer.clip_grad_norm = 1.0",
                "trainer.lr_schedule.decay = cosine"):
        assert key in err, err
    assert main(["recipe=wide_deep", "strategy=parameter_server", "cluster.ps=1", "trainer.precision=fp16-mixed",
                 "trainer.clip_grad_norm=1.0", "cluster=1x2"]) == 2
    err = capsys.readouterr().err  # beside another rule's problem, too
    assert "invalid configuration (3 problems)" in err and "trainer.clip_grad_norm = 1.0" in err, err


def test_real_process_exit_code_and_no_traceback(tmp_path):
    proc = dlaunch("strategy=mirrored", "cluster=1x3", "trainer.stpes=3", cwd=tmp_path)
    assert proc.returncode == 2
    assert "trainer.stpes" in proc.stdout + proc.stderr and "did you mean trainer.steps" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr + proc.stdout
    assert not (tmp_path / "outputs").exists(), "a config error must not create a run"


def test_a_config_dir_that_does_not_exist_is_named(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--config-dir", "nodir", "recipe=mine"]) == 2
    err = capsys.readouterr().err
    assert "--config-dir = " in err and "no such directory" in err and "Traceback" not in err


def test_a_yaml_with_many_mistakes_names_every_key_in_one_screen(capsys, monkeypatch, tmp_path):
    """Six unknown keys, too many to show each in full on one screen: each on one line with its value, what was
    meant and (once per section) the allowed keys. It showed four in full and named the last two without their
    values or the allowed keys."""
    from launcher.config import compose as composer

    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)
    # main() sets the primary config for the process: the later tests of this process compose dlaunch's own again
    monkeypatch.setattr(composer, "CONFIG_DIRS", [])
    monkeypatch.setattr(composer, "CONFIG_NAME", composer.CONFIG_NAME)
    (tmp_path / "bad.yaml").write_text("defaults:\n  - config\n  - _self_\ntrainer:\n  stepz: 5\n  precison: bf16-mixed\n"
                                       "  evl_every: 3\ninput:\n  global_bach_size: 4\ncluster:\n  devise: cpu\n"
                                       "launch:\n  dryrun: true\n")
    assert main(["--config-dir", str(tmp_path), "--config-name", "bad"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration (6 problems)" in err and len(err.splitlines()) <= 25, err
    assert err.count("allowed: steps, seed, log_every") == 1, err
    assert "trainer.stepz = 5: unknown key; did you mean trainer.steps?; allowed: steps, seed, log_every" in err, err
    assert "trainer.precison = bf16-mixed: unknown key; did you mean trainer.precision?\n" in err, err
    assert "input.global_bach_size = 4: unknown key; did you mean input.global_batch_size?; allowed: global_batch_size" in err
    assert "launch.dryrun = true: unknown key; did you mean launch.dry_run?; allowed: dry_run," in err
    assert "cluster.devise = cpu" in err and "trainer.evl_every = 3" in err and "more:" not in err, err


def test_a_strategy_named_over_the_groups_choice_says_to_choose_it_as_a_group(capsys, monkeypatch, tmp_path):
    """``strategy: {name: mirrored}`` in a user's YAML keeps the group's one_device settings: it said ``strategy.device
    = null: unknown key``, a key the user never wrote."""
    from launcher.config import compose as composer

    monkeypatch.setattr(cli_job, "cuda_devices", lambda: 0)
    monkeypatch.setattr(composer, "CONFIG_DIRS", [])
    monkeypatch.setattr(composer, "CONFIG_NAME", composer.CONFIG_NAME)
    (tmp_path / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\nstrategy:\n  name: mirrored\n")
    assert main(["--config-dir", str(tmp_path), "--config-name", "mine", "cluster.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration (1 problem)" in err and "strategy.device" not in err, err
    assert "strategy.name = mirrored\n    names strategy mirrored over strategy one_device's settings (device)" in err
    assert "strategy=mirrored on the command line, or `- override /strategy: mirrored`" in err
    assert main(["strategy.name=mesh", "cluster.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "(1 problem)" in err and "names strategy mesh over strategy one_device's settings" in err, err
    assert main(["strategy=mirrored", "strategy.device=cpu:0", "cluster.device=cpu"]) == 2  # a key typed: as before
    assert "unknown key under strategy (a key of strategy=one_device)" in capsys.readouterr().err
