"""The lines a stopped run ends with: what was saved, and the command that goes on from it."""

from __future__ import annotations


def test_a_stop_says_truthfully_why_there_is_no_checkpoint_and_a_sweeps_job_leaves_the_command_to_the_sweep(tmp_path):
    """A stop before any save began (during start-up) is not "none was complete"; a sweep's job names no command of its
    own: the sweep prints the one that resumes every job."""
    from launcher.cli.resume_lines import after_signal
    from launcher.config.compose import compose_and_validate

    spec = compose_and_validate(["trainer.checkpoint.every_steps=10", "cluster.device=cpu"], cuda_devices=0)
    told = after_signal(spec, tmp_path, 143, None)
    assert "no checkpoint to resume from: it stopped before it saved one;" in told and "none was complete" not in told
    assert f"dlaunch resume {tmp_path} starts again at step 0" in told
    (tmp_path / "checkpoints" / ".step-00000010.partial").mkdir(parents=True)
    assert "no checkpoint to resume from: none was complete;" in after_signal(spec, tmp_path, 143, None)
    assert "dlaunch resume" not in after_signal(spec, tmp_path, 143, None, in_sweep=True)
    saved = tmp_path / "checkpoints" / "step-00000010"
    assert after_signal(spec, tmp_path, 143, saved, in_sweep=True) == f"stopped (exit 143); checkpoint {saved}"


def test_a_stopped_script_is_told_its_newest_save_or_that_it_has_none_in_the_run(tmp_path):
    """A script saves its own checkpoints: the stop's line names its newest save (ScriptCheckpoints' place in the run),
    or says there is none there, as a recipe's names its checkpoint."""
    from launcher.checkpoint import layout
    from launcher.cli.resume_lines import after_signal
    from launcher.config.compose import choose_user_recipes, compose_and_validate

    (tmp_path / "train.py").write_text("print('training')\n")
    spec = compose_and_validate(choose_user_recipes([f"script={tmp_path / 'train.py'}", "cluster.device=cpu"]), cuda_devices=0)
    run_dir = tmp_path / "run"
    told = after_signal(spec, run_dir, 130, None)
    assert told == (f"stopped (exit 130); {run_dir / 'checkpoints'} holds no ScriptCheckpoints save (a script that "
                    f"saves its own checkpoints elsewhere restores from them itself); dlaunch resume {run_dir} runs it "
                    "again with the same arguments")
    partial = layout.partial_dir(run_dir / "checkpoints", 40)
    partial.mkdir(parents=True)
    (partial / ".metadata").write_bytes(b"")  # torch.distributed.checkpoint's index: with the manifest, a complete step
    layout.commit(partial, {"format": 1, "step": 40}, keep=3)
    newest = layout.step_dir(run_dir / "checkpoints", 40)
    told = after_signal(spec, run_dir, 130, None)
    assert told == (f"stopped (exit 130); the script's newest save: {newest}; dlaunch resume {run_dir} runs it again with "
                    "the same arguments, and its ScriptCheckpoints.restore goes on from step 40")
    assert "dlaunch resume" not in after_signal(spec, run_dir, 130, None, in_sweep=True)


def test_nodes_that_share_a_run_directory_each_resume_as_themselves(tmp_path):
    """Two nodes with one hydra.run.dir: the directory's Hydra record was the last writer's (node 1's), so `dlaunch
    resume DIR` on node 0 ran node 1's command and waited for a node 0 that never came. Now the record is node 0's,
    a resume there names the node, and node 1's stop line says its own."""
    from omegaconf import OmegaConf

    from launcher.cli.resume import rerun_args
    from launcher.cli.resume_lines import after_signal
    from launcher.config.compose import compose_and_validate

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(["cluster=2x1", "cluster.node_rank=0"]), run / ".hydra" / "overrides.yaml")
    assert rerun_args(run, [])[:2] == ["cluster=2x1", "cluster.node_rank=0"]  # a directory of node 0's alone
    for name in (".dlaunch.lock", ".dlaunch.node1.lock"):
        (run / name).write_text("")
    try:
        rerun_args(run, ["trainer.steps=20"])
        raise AssertionError("a shared directory resumed without a node rank")
    except ValueError as exc:
        assert "shared by the nodes of a multi-node run (node 0 and node1)" in str(exc)
        assert f"dlaunch resume {run} cluster.node_rank=N" in str(exc)
    (run / ".dlaunch").mkdir()
    (run / ".dlaunch" / "token").write_text("node-0s-token\n")  # node 0 made it; node 1 gave it on its command line
    again = rerun_args(run, ["cluster.node_rank=1"])
    assert "cluster.node_rank=1" in again and "cluster.token=node-0s-token" in again, again
    assert not any(a.startswith("cluster.token") for a in rerun_args(run, ["cluster.node_rank=0"]))  # node 0 keeps it
    spec = compose_and_validate(["strategy=mirrored", "cluster=2x1", "cluster.node_rank=1", "cluster.master_port=29500",
                                 "trainer.checkpoint.every_steps=10", "cluster.device=cpu"], cuda_devices=0)
    saved = run / "checkpoints" / "step-00000010"
    assert after_signal(spec, run, 143, saved).endswith(f"resume with: dlaunch resume {run} cluster.node_rank=1")
