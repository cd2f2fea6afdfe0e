"""What a run directory records of the command that ran there: Hydra's record (``.hydra/``), which ``dlaunch resume``
and the sweep table read, and ``config.yaml``, the validated config as it ran."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.config import script as script_config
from launcher.runtime import outputs


def record_run(spec: Any, cfg: Any, run_dir: Path, resume_from: Path | None) -> None:
    """Node 0 owns the run's files; nodes that share the directory keep node 0's command in Hydra's record."""
    from launcher.checkpoint import lock  # torch: not at the command's start

    if not spec.cluster.node_rank or not lock.node_0_was_here(run_dir):
        record_hydra(run_dir, cfg)
    if not spec.cluster.node_rank:
        outputs.start_run(run_dir, resuming=resume_from is not None,
                          script=spec.script is not None and outputs.same_script(run_dir, spec.script.path))
        (run_dir / outputs.CONFIG).write_text(as_run(spec))
        outputs.record_command(run_dir)


def record_hydra(run_dir: Path, cfg: Any) -> None:
    """Hydra's record of this job (``cfg``), as Hydra writes it (config, hydra and overrides YAML), with a user
    recipe's option as the user typed it: ``dlaunch resume`` and the sweep table read it."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from launcher.config import user_recipes

    hydra = HydraConfig.instance().cfg  # {"hydra": ...}
    record = run_dir / outputs.HYDRA_RECORD
    record.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, record / "config.yaml")
    OmegaConf.save(hydra, record / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(user_recipes.as_typed([str(o) for o in hydra.hydra.overrides.task])),
                   record / "overrides.yaml")
    if script_config.ARGS:  # `-- ARGS`: no override, so Hydra's record has no place for them; JSON: `${x}` stays text
        (record / outputs.SCRIPT_ARGS).write_text(json.dumps(list(script_config.ARGS)) + "\n")
    else:
        (record / outputs.SCRIPT_ARGS).unlink(missing_ok=True)


def as_run(spec: Any) -> str:
    """``config.yaml``: the validated config, its recipe section as the recipe's ``Config`` read it (the defaults
    its YAML leaves out too), so that the file says what ran even after the recipe's code changes."""
    from omegaconf import OmegaConf

    from launcher.runtime import recipe as recipe_lib

    data = spec.model_dump(mode="json")
    if spec.script is None:
        data["recipe"] = recipe_lib.as_read(data["recipe"])  # the module the validation imported
        return OmegaConf.to_yaml(data)
    return SCRIPT_RUN + OmegaConf.to_yaml(data)


SCRIPT_RUN = ("# A script's run: `script` ran in place of a recipe and its loop. `recipe` only names it; of `trainer`,\n"
              "# a script takes seed and precision (docs/SCRIPTS.md), the other keys are dlaunch's loop's.\n")
