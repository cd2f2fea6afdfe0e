"""Before any process starts: a checkpoint whose model tensors have other shapes than this run's model.

A recipe setting that shapes the model (``recipe.d_model=32`` on a resume) used to start every worker, which
failed at the load a while later; the parent builds the model on the meta device (shapes, no values) and says
so at once, exit 2. Only where a recipe setting changed since the checkpoint: otherwise the model is the one
that was saved, and no build is spent on it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from launcher.checkpoint import layout, manifest
from launcher.checkpoint.errors import CheckpointError

log = logging.getLogger("dlaunch")


def check_shapes(path: Path, spec: Any, run_dir: Path) -> None:
    """CheckpointError naming the tensors whose saved shape differs from what this run's model builds."""
    if spec.script is not None or spec.strategy.name == "parameter_server":  # no model here; the ps tasks hold it
        return
    changed = manifest.recipe_diff(layout.read_manifest(path).get("recipe", {}), spec)
    if not changed:
        return
    built = model_shapes(spec, run_dir)
    held = _saved_shapes(path)
    differ = [(name, held[name], built[name]) for name in sorted(set(held) & set(built)) if held[name] != built[name]]
    if not differ:
        return
    shown = "; ".join(f"model.{name} is {list(old)} in the checkpoint and {list(new)} here" for name, old, new in differ[:3])
    more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
    settings = ", ".join(f"recipe.{key}: {old} -> {new}" for key, old, new in changed)
    raise CheckpointError(f"{path} does not fit this run's model: {shown}{more}; since the checkpoint {settings}. To "
                          "resume, set them back; to train the new shape from step 0, add trainer.resume=never or use "
                          "another hydra.run.dir")


def model_shapes(spec: Any, run_dir: Path) -> dict[str, tuple[int, ...]]:
    """The recipe's model state, built on the meta device as a parameter-server plan builds it; {} if it cannot be
    (the workers' load says what does not fit)."""
    from launcher.distribute.meta_scope import variables_scope
    from launcher.runtime.ps_task import build_variables

    try:
        with variables_scope():
            model, _ = build_variables(spec, run_dir)
        return {name: tuple(t.shape) for name, t in model.state_dict().items()}
    except Exception as exc:  # noqa: BLE001 - the recipe's own code, built here only to compare shapes
        log.debug("the model's shapes were not compared with the checkpoint before starting: %s", exc)
        return {}


def _saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from launcher.checkpoint.safe import saved_entries

    return {name: tuple(m.size) for name, m in saved_entries(path, "model.").items() if hasattr(m, "size")}
