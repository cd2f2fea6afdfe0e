"""What a run that ended early says last: what it saved, and the one command that goes on from it.

    stopped (exit 143); checkpoint outputs/.../checkpoints/step-00000040
    resume with: dlaunch resume outputs/2026-01-02/10-11-12

A failed run names its newest checkpoint and the same command (once the cause is fixed); a sweep's job leaves the
command to the sweep, which prints one for every job; a script's run names its own ``ScriptCheckpoints`` save.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any


def command(run_dir: Path, spec: Any = None) -> str:
    """The command that resumes the run in ``run_dir``, as the user would type it; with this node's rank where nodes
    share the directory (``spec``: this node's run)."""
    from launcher.checkpoint import lock

    shared = spec is not None and spec.cluster.nodes > 1 and lock.other_nodes_here(run_dir)
    mine = f" cluster.node_rank={spec.cluster.node_rank or 0}" if shared else ""
    return f"dlaunch resume {shlex.quote(str(run_dir))}{mine}"


def saved(spec: Any, run_dir: Path) -> Path | None:
    """The checkpoint a stopped run resumes from (None: checkpoints are off, or none is complete)."""
    from launcher.checkpoint import layout

    return layout.latest(spec.trainer.checkpoint.root(run_dir)) if spec.trainer.checkpoint.every_steps else None


def after_signal(spec: Any, run_dir: Path, code: int, checkpoint: Path | None, in_sweep: bool = False) -> str:
    """The lines shown when a run stopped on a signal: what was saved (``checkpoint``), and how to go on. A sweep's
    job (``in_sweep``) leaves how to go on to the sweep's own line, which resumes every job."""
    from launcher.checkpoint import layout

    if spec.script is not None:
        return _script_after_signal(run_dir, code, layout.latest(run_dir / "checkpoints"), in_sweep)
    from launcher.runtime import outputs

    lost = outputs.unsaved_stop(run_dir, None if checkpoint is None else layout.step_of(checkpoint))
    if checkpoint is None:
        why = lost["why"] if lost else _why_none(spec, run_dir)
        again = "at step 0" if spec.trainer.resume in ("auto", "never") else f"from {spec.trainer.resume}"
        return f"stopped (exit {code}); no checkpoint to resume from: {why}" + (
            "" if in_sweep else f"; {command(run_dir, spec)} starts again {again}")
    if lost:  # the storage refused the stop's own save (trainer.checkpoint.on_error=warn)
        trained_again = f"from step {layout.step_of(checkpoint)}: the steps after it up to {lost['step']} are trained again"
        return f"stopped (exit {code}); {lost['why']}\n" + (
            f"a resume goes on {trained_again}" if in_sweep else f"resume with: {command(run_dir, spec)} ({trained_again})")
    return f"stopped (exit {code}); checkpoint {checkpoint}" + ("" if in_sweep else f"\nresume with: {command(run_dir, spec)}")


def _script_after_signal(run_dir: Path, code: int, newest: Path | None, in_sweep: bool) -> str:
    """A script saves its own checkpoints: its newest save in the run's ``checkpoints`` (``ScriptCheckpoints``' own
    place), or that there is none there; a resume runs the script again, and its ``restore`` goes on from that save."""
    from launcher.checkpoint import layout

    again = "" if in_sweep else f"; {command(run_dir)} runs it again with the same arguments"
    if newest is None:
        return (f"stopped (exit {code}); {run_dir / 'checkpoints'} holds no ScriptCheckpoints save (a script that saves "
                f"its own checkpoints elsewhere restores from them itself){again}")
    return (f"stopped (exit {code}); the script's newest save: {newest}{again}, and its ScriptCheckpoints.restore "
            f"goes on from step {layout.step_of(newest)}")


def _why_none(spec: Any, run_dir: Path) -> str:
    """Why a stopped run has no checkpoint: they are off, a save began and none finished, or none had begun."""
    if not spec.trainer.checkpoint.every_steps:
        return "checkpoints are off (trainer.checkpoint.every_steps=0)"
    root = spec.trainer.checkpoint.root(run_dir)
    begun = root.is_dir() and any(p.name.startswith(("step-", ".step-")) for p in root.iterdir())
    return "none was complete" if begun else "it stopped before it saved one"


def after_failure(spec: Any, run_dir: Path, in_sweep: bool = False) -> str:
    """After a failed run, the newest checkpoint and how to go on from it once the cause is fixed ("": none). A
    script's: ScriptCheckpoints' default directory, which ``dlaunch resume`` runs the script again beside. A sweep's
    job (``in_sweep``) leaves how to go on to the sweep's own line, which resumes every job."""
    from launcher.checkpoint import layout

    if spec.cluster.node_rank:
        return ""
    checkpoint = layout.newest(spec, run_dir)
    if checkpoint is None:
        return _nothing_saved(spec, run_dir)
    damage = _failed_to_load(run_dir, checkpoint)
    if damage:  # a restart, which checks sizes alone, spent every attempt on it: a resume verifies and passes it over
        return (f"newest checkpoint: {checkpoint} is damaged: {damage}; " + ("the sweep's last line" if in_sweep else
                f"once the cause is fixed, {command(run_dir)}") + " goes on from the newest intact one")
    if in_sweep:
        return f"newest checkpoint: {checkpoint} (the sweep's last line says how to go on)"
    again = " (the script runs again; its ScriptCheckpoints.restore goes on from there)" if spec.script else ""
    return f"newest checkpoint: {checkpoint}\nonce the cause is fixed, go on from it with: {command(run_dir)}{again}"


def _nothing_saved(spec: Any, run_dir: Path) -> str:
    """A failed run that trained steps with checkpoints off: they are lost, and how the next run keeps them ("": it
    trained none, or it saves its own, a script)."""
    from launcher.runtime import outputs

    if spec.script is not None or spec.trainer.checkpoint.every_steps:
        return ""
    summary = outputs.read_summary(run_dir) or {}
    trained = summary.get("last_completed_step")
    if summary.get("status") != "failed" or not isinstance(trained, int) or not trained:  # not this failure's record
        return ""
    done = trained >= spec.trainer.steps
    when = "after its last step (in the final evaluation, or as it ended)" if done else f"after step {trained}"
    return (f"nothing was saved: the run failed {when} with checkpoints off, and the training up to step {trained} "
            "is lost; with trainer.checkpoint.every_steps=N a run saves every N steps and its last one, and after a "
            "failure `dlaunch resume RUN_DIR` goes on from there" + (" (after the last step, only the evaluation "
                                                                    "runs again)" if done else ""))


def _failed_to_load(run_dir: Path, checkpoint: Path) -> str | None:
    """Why ``checkpoint`` is damaged, where the run failed loading it (its digests, read now); else None."""
    from launcher.checkpoint import layout
    from launcher.runtime import outputs

    error = ((outputs.read_summary(run_dir) or {}).get("error") or {}).get("exception") or ""
    if not error.startswith(f"CheckpointError: cannot load {checkpoint}"):
        return None
    return layout.check(checkpoint, full=True)
