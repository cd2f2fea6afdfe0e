"""dlaunch --help, --version and torchrun habits: answered at once, before torch is imported."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from launcher.cli import helpgen, help_data
from tests.conftest import dlaunch


def test_help_data_is_generated_from_the_current_schema():
    assert helpgen.TARGET.read_text() == helpgen.generate(), "run: python -m launcher.cli.helpgen"
    assert help_data.GROUPS["strategy"]


def imports_torch(tmp_path, *args: str) -> bool:
    """Whether answering ``dlaunch ARGS`` imported torch (or numpy): what makes an answer take seconds, not 0.1 s.
    (Timed on a shared machine, the answer was a flaky test; what it imports is what makes it quick.)"""
    code = (f"import sys; from launcher.cli.main import main; sys.argv = ['dlaunch', *{list(args)!r}]; main(); "
            "print('torch' in sys.modules or 'numpy' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    answer = done.stderr.split()[-1] if done.stderr.split() else ""
    assert answer in ("True", "False"), done.stdout + done.stderr  # it answered and printed, rather than exit
    return answer == "True"


def test_help_lists_subcommands_groups_and_settings_with_descriptions_quickly(tmp_path):
    proc = dlaunch("--help", cwd=tmp_path)
    assert not imports_torch(tmp_path, "--help")
    assert proc.returncode == 0
    for expected in ("dlaunch recipes ls", "dlaunch report", "dlaunch resume RUN_OR_SWEEP_DIR", "NxM", "2x8",
                     "trainer.precision [fp32]", "launch.max_restarts"):
        assert expected in proc.stdout, expected
    assert re.search(r"^    mirrored +synchronous data parallelism", proc.stdout, re.M)  # the schema's docstring
    assert not [line for line in proc.stdout.splitlines() if line != line.rstrip()]


def test_version_is_the_package_version(tmp_path):
    from importlib.metadata import version

    proc = dlaunch("--version", cwd=tmp_path)
    assert not imports_torch(tmp_path, "--version")
    assert proc.returncode == 0 and proc.stdout == f"dlaunch {version('dlaunch')}\n"


def test_torchrun_flags_are_mapped_to_overrides(tmp_path):
    proc = dlaunch("--nnodes=2", "--nproc_per_node", "8", "--master_port=29500", "--rdzv_endpoint=node0:29400", "--bogus",
                   cwd=tmp_path)
    assert proc.returncode == 2
    assert "unrecognized arguments" not in proc.stderr
    for expected in ("cluster=2xDEVICES", "cluster=NODESx8", "cluster.master_port=29500", "--bogus", "unknown option",
                     "cluster.master_addr=node0 cluster.master_port=29400"):
        assert expected in proc.stderr, expected


def test_torchrun_habits_with_a_script_get_its_dlaunch_form(tmp_path):
    bare = dlaunch("train.py", cwd=tmp_path)  # torchrun train.py
    assert bare.returncode == 2 and "did you mean script=train.py?" in bare.stderr, bare.stderr
    flags = dlaunch("script=train.py", "--epochs", "3", cwd=tmp_path)  # the script's arguments without --
    assert flags.returncode == 2, flags.stderr
    assert "a script's own arguments go after --: dlaunch script=train.py -- ARGS" in flags.stderr


@pytest.mark.parametrize("bad", ["trainer.steps=-1", "trainer.stpes=5"], ids=["bad-value", "unknown-key"])
def test_a_config_error_answers_without_importing_torch(tmp_path, bad):
    code = ("import sys; from launcher.cli.main import main; "
            f"sys.argv = ['dlaunch', '{bad}', 'cluster=1x3', 'cluster.device=cpu']; "
            "c = main(); print(c, 'torch' in sys.modules or 'numpy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.stdout.split()[-2:] == ["2", "False"], done.stdout + done.stderr
    assert bad.split("=")[0] in done.stderr and "cluster" in done.stderr  # the other problem too


def test_a_torchrun_command_line_gets_the_same_run_in_dlaunch_words():
    from launcher.cli.usage import flag_message

    text = flag_message(["--standalone", "--nproc_per_node=2", "train.py", "--epochs", "1"])
    assert "the same run: dlaunch script=train.py strategy=mirrored cluster=1x2 -- --epochs 1" in text
    assert "--epochs" not in text.split("the same run")[0]  # the script's own argument, not an unknown option
    two_nodes = flag_message(["--nnodes=2", "--nproc_per_node", "8", "train.py"])
    assert "the same run: dlaunch script=train.py strategy=multi_worker_mirrored cluster=2x8" in two_nodes
    node1 = flag_message(["--nnodes=2", "--nproc_per_node=8", "--node_rank=1", "--master_addr=10.0.0.1", "train.py"])
    assert "cluster=2x8 cluster.node_rank=1 cluster.master_addr=10.0.0.1" in node1
    assert "the same run" not in flag_message(["--nnodes=1:4", "--nproc_per_node=gpu", "train.py"])  # no plain sizes
    from launcher.cluster import gpus

    every = flag_message(["--nproc_per_node=gpu", "train.py"])  # torchrun's "every GPU here": a number in a shape
    assert f"use cluster=NODESx{gpus.count() or 'N'} (devices per node)" in every and "xgpu" not in every
    after = flag_message(["script=train.py", "--nproc_per_node=2", "--", "--config", "cfg.py"])
    assert "script=cfg.py" not in after  # a .py after -- is the script's argument, not a script


def test_a_script_with_its_own_flags_as_python_takes_them_gets_the_same_run_not_hydras_usage(tmp_path):
    """`dlaunch train.py --epochs 1`, the first thing a `python train.py` or `accelerate launch` user types, got
    Hydra's argparse usage and `unrecognized arguments`; the script's arguments keep their quoting."""
    from tests.conftest import dlaunch

    (tmp_path / "train.py").write_text("print('trained')\n")
    done = dlaunch("train.py", "--epochs", "1", "--name", "my run", cwd=tmp_path, device=None)  # as typed
    assert done.returncode == 2 and "usage:" not in done.stderr + done.stdout, done.stderr
    assert "the same run: dlaunch script=train.py -- --epochs 1 --name 'my run'" in done.stderr + done.stdout
    from launcher.cli.usage import flag_message

    assert flag_message(["train.py"]) is None  # no flag: the config error says `did you mean script=train.py?`
    assert flag_message(["train.py", "lr=3"]) is None
    # dlaunch's settings typed after the script stay dlaunch's: after --, the script would get them (and refuse them)
    mixed = flag_message(["train.py", "--epochs", "1", "cluster.device=cpu", "+trainer.x=1", "lr=3"])
    assert "the same run: dlaunch script=train.py cluster.device=cpu +trainer.x=1 -- --epochs 1 lr=3" in mixed, mixed


def test_accelerates_mixed_precision_with_a_script_points_at_trainer_precision_and_strategy_autocast():
    """A script runs its own loop: it takes trainer.precision by entering strategy.autocast(); a recipe gets it as is."""
    from launcher.cli.usage import flag_message

    for argv in (["--num_processes=2", "--mixed_precision=bf16", "train.py"], ["--mixed_precision=bf16", "script=train.py"]):
        line = next(x for x in flag_message(argv).splitlines() if "--mixed_precision" in x)
        assert "use trainer.precision=bf16-mixed" in line and "strategy.autocast()" in line, line
    recipe = flag_message(["--num_processes=2", "--mixed_precision=bf16"])
    assert "use trainer.precision=bf16-mixed" in recipe
    same = flag_message(["--mixed_precision=fp16", "--num_processes=2", "train.py", "--steps", "5"])
    assert "the same run: dlaunch script=train.py strategy=mirrored cluster=1x2 trainer.precision=fp16-mixed -- --steps 5" in same
    assert "trainer.precision" not in flag_message(["--mixed_precision=no", "train.py"]).split("the same run")[1]


def test_launcher_flags_beside_a_recipes_overrides_get_the_same_run_with_them():
    """`dlaunch --num_processes=2 --mixed_precision=bf16 recipe=linear` said `use cluster=1x2` and a torchrun example:
    `cluster=1x2` alone is refused (one_device has one replica). A recipe's run gets its whole command, as a script's."""
    from launcher.cli.usage import flag_message

    text = flag_message(["--num_processes=2", "--mixed_precision=bf16", "recipe=linear"])
    assert "the same run: dlaunch recipe=linear strategy=mirrored cluster=1x2 trainer.precision=bf16-mixed" in text
    assert "use strategy=mirrored cluster=1x2" in text and "torchrun" not in text
    unknown = flag_message(["--foo=3", "recipe=linear"])  # nothing a run would take from it: the example, as before
    assert "the same run" not in unknown and "e.g. torchrun --nnodes=2" in unknown


def test_the_same_run_keeps_hydras_own_options():
    """`--config-dir cnn` and `-m` were dropped from "the same run": the first then failed with `unknown recipe`, the
    second ran one job with a comma-separated value."""
    from launcher.cli.usage import flag_message

    text = flag_message(["--num_processes=2", "--mixed_precision=bf16", "--config-dir", "cnn", "recipe=cnn16"])
    assert ("the same run: dlaunch --config-dir cnn recipe=cnn16 strategy=mirrored cluster=1x2 "
            "trainer.precision=bf16-mixed") in text
    text = flag_message(["-m", "--nproc_per_node=2", "-cd=conf", "--config-name", "mine", "recipe.optimizer.lr=0.1,0.01"])
    assert "the same run: dlaunch -m -cd=conf --config-name mine recipe.optimizer.lr=0.1,0.01 strategy=mirrored cluster=1x2" in text
    cases = {  # Hydra's options as typed -> as "the same run" gives them, before the cluster
        ("--info", "config"): "--info config", ("--info", "recipe=linear"): "--info recipe=linear",
        ("--config-dir", "--cfg", "job"): "--config-dir --cfg job", ("--config-dir", "a=b"): "--config-dir a=b",
        ("--experimental-rerun", "x.pickle"): "--experimental-rerun x.pickle",
    }
    for typed, kept in cases.items():
        text = " ".join(flag_message(["--nproc_per_node=2", *typed]).split())
        assert f"the same run: dlaunch {kept} strategy=mirrored cluster=1x2" in text, text
    script = flag_message(["--nproc_per_node=2", "trainer.precision=bf16-mixed", "train.py", "--lr", "1"])
    assert "the same run: dlaunch script=train.py trainer.precision=bf16-mixed strategy=mirrored cluster=1x2 -- --lr 1" in script
    # an option's value that ends in .py is no script: -cd's directory, and the script after it
    script = flag_message(["-cd", "conf.py", "--nproc_per_node=2", "train.py", "--lr", "1"])
    assert "the same run: dlaunch script=train.py -cd conf.py strategy=mirrored cluster=1x2 -- --lr 1" in script, script


def test_accelerates_cpu_flag_is_cluster_device_cpu_in_the_mapping_and_the_same_run():
    from launcher.cli.usage import flag_message

    text = flag_message(["--num_processes=2", "--cpu", "train_ddp.py", "--epochs", "1"])
    assert "unknown option" not in text and "use cluster.device=cpu" in text
    assert "the same run: dlaunch script=train_ddp.py strategy=mirrored cluster=1x2 cluster.device=cpu -- --epochs 1" in text


def test_a_flag_longer_than_the_column_widens_it_for_every_row():
    from launcher.cli.usage import flag_message

    text = flag_message(["--standalone", "--nproc_per_node=2", "--rdzv_endpoint=localhost:29400", "train.py"])
    rows = [line for line in text.splitlines() if line.startswith("  ")]
    assert len(rows) == 4 and len({line.index(" use ") if " use " in line else line.index(" a script") for line in rows}) == 1


def test_a_scripts_own_flags_typed_before_the_separator_get_the_same_run_with_them_after_it():
    """`dlaunch script=train.py --epochs 1 strategy=mirrored` said where the arguments go, but gave no command."""
    from launcher.cli.usage import flag_message

    text = " ".join(flag_message(["script=train.py", "--epochs", "1", "--learning-rate=0.1", "--nproc_per_node=2",
                                  "cluster.device=cpu"]).split())
    assert ("the same run: dlaunch script=train.py cluster.device=cpu strategy=mirrored cluster=1x2 -- --epochs 1 "
            "--learning-rate=0.1") in text, text
    assert "the same run" not in flag_message(["--epochs", "1", "recipe=linear"])  # no script: nothing to give them to


def test_the_same_run_keeps_every_flag_it_maps_and_leaves_a_scripts_own_sections_to_it():
    """A script-mode review: --max_restarts, --monitor_interval and --rdzv_endpoint were mapped in the rows but
    dropped from the same run; a Hydra script's own trainer.max_epochs=3 was moved into dlaunch's settings; torchrun's
    -m MODULE became a sweep of the default recipe."""
    from launcher.cli.usage import flag_message

    text = flag_message(["--max_restarts=3", "--monitor_interval=1", "--nproc_per_node=2", "train.py", "--epochs", "2"])
    assert ("the same run: dlaunch script=train.py strategy=mirrored cluster=1x2 launch.max_restarts=3 "
            "launch.monitor_interval_s=1 -- --epochs 2") in text
    two = flag_message(["--rdzv_endpoint=10.0.0.1:29400", "--nnodes=2", "--nproc_per_node=2", "train.py"])
    assert "cluster=2x2 cluster.master_addr=10.0.0.1 cluster.master_port=29400" in two
    own = flag_message(["--nproc_per_node=2", "app.py", "model.lr=0.1", "trainer.max_epochs=3", "input.path=/data",
                        "launch.max_restarts=2", "cluster.device=cpu"])
    assert ("the same run: dlaunch script=app.py launch.max_restarts=2 cluster.device=cpu strategy=mirrored cluster=1x2 "
            "-- model.lr=0.1 trainer.max_epochs=3 input.path=/data") in own
    for typed in (["-m", "pkg.train"], ["--module", "pkg.train"]):
        module = flag_message(["--nproc_per_node=2", *typed, "--epochs", "1"])
        assert "-m pkg.train a module runs as script.module=pkg.train" in " ".join(module.split()), module
        assert "the same run: dlaunch script.module=pkg.train strategy=mirrored cluster=1x2 -- --epochs 1" in module
    assert flag_message(["-m", "strategy=mirrored,fsdp"]) is None  # Hydra's -m: a sweep
    assert "use nothing: each rank keeps its output in RUN_DIR/logs/" in flag_message(["--tee=3", "train.py"])
    accumulate = flag_message(["--gradient_accumulation_steps=4", "--num_processes=2"])
    assert "use trainer.grad_accum_steps=4" in accumulate


def test_a_scripts_own_dash_m_and_a_sweep_deleting_a_key_are_not_torchruns_module():
    from launcher.cli.usage import flag_message

    assert "the same run: dlaunch script=train.py -- -m resnet50" in flag_message(["train.py", "-m", "resnet50"])
    assert flag_message(["-m", "~recipe", "script=x.py"]) is None


def test_a_node_other_than_0_gets_the_token_in_its_same_run():
    """Node 0 admits the nodes that give its token: the same run of a torchrun node 1 lacked it (a new-user pass)."""
    from launcher.cli.usage import flag_message

    text = flag_message(["--nnodes=2", "--nproc_per_node=8", "--node_rank=1", "--master_addr=10.0.0.1", "train.py"])
    assert "cluster.node_rank=1 cluster.master_addr=10.0.0.1 cluster.token=TOKEN" in text
    assert "(TOKEN: the one node 0's plan shows; docs/OPERATIONS.md)" in text
    assert "cluster.token" not in flag_message(["--nnodes=2", "--nproc_per_node=8", "--node_rank=0", "train.py"])
