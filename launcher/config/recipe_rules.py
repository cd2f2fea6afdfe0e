"""Rules that need the recipe itself: the run asks only for what its module has.

The validation imports the recipe once (to check its ``Config``); these rules read that module:
a ``train_step`` that does its own backward and update (manual mode) leaves dlaunch nothing to add to
them, ``trainer.eval_every`` needs an ``evaluate``, fused SGD or Adagrad kernels need plain tensors, and an
optimizer that makes its state when it is built needs every rank to hold real parameters.
"""

from __future__ import annotations

from typing import Any

from launcher.config.errors import ConfigError, Problem


def check(spec: Any, loaded: Any) -> None:
    """Every problem of ``spec`` with the recipe ``loaded`` (a ``LoadedRecipe``), in one ``ConfigError``."""
    problems = [*_manual_step(spec, loaded), *_evaluation(spec, loaded), *_fused_kernels(spec, loaded),
                *_state_at_build(spec, loaded)]
    if problems:
        raise ConfigError(problems)


def _manual_step(spec: Any, loaded: Any) -> list[Problem]:
    """A recipe whose train_step updates by itself (manual mode) owns backward and the update: dlaunch cannot add to them."""
    if not loaded.manual:
        return []
    t = spec.trainer
    owned = [("trainer.precision", t.precision, t.precision == "fp16-mixed", "GradScaler must scale the loss before backward"),
             ("trainer.grad_accum_steps", t.grad_accum_steps, t.grad_accum_steps > 1, "micro-batches need dlaunch to call backward"),
             ("trainer.clip_grad_norm", t.clip_grad_norm, t.clip_grad_norm is not None, "clipping goes between backward and the update")]
    does = f"recipe {spec.recipe.name}'s train_step(model, batch, optimizer) does its own backward and update"
    problems = [Problem(key=key, value=value, message=f"{does}, so dlaunch cannot apply this ({why}); do it in the step, "
                        "or drop the optimizer argument so that dlaunch does backward and the update")
                for key, value, on, why in owned if on]
    if not spec.input.drop_remainder and spec.num_replicas > 1:
        problems.append(Problem(key="input.drop_remainder", value=False, message=(
            f"{does}, so dlaunch cannot weight the replicas' unequal shares of a last partial batch in the loss before "
            "backward; keep input.drop_remainder=true, or drop the optimizer argument so that dlaunch does backward")))
    return problems


def _evaluation(spec: Any, loaded: Any) -> list[Problem]:
    """``trainer.eval_every`` with a recipe that has no ``evaluate``: nothing would run, and the plan would say it does."""
    if not spec.trainer.eval_every or loaded.evaluate() is not None:
        return []
    return [Problem(key="trainer.eval_every", value=spec.trainer.eval_every,
                    message=f"recipe {spec.recipe.name} has no evaluate(model, parts), so there is nothing to run every "
                    f"{spec.trainer.eval_every} steps; set 0, or add evaluate to the recipe (docs/RECIPES.md)")]


def _fused_kernels(spec: Any, loaded: Any) -> list[Problem]:
    """``recipe.optimizer.implementation=fused`` for an optimizer torch has no DTensor kernel of, under a strategy
    that splits parameters into DTensors (it says so in its ``refuses``)."""
    optimizer = getattr(loaded.config, "optimizer", None)
    why = spec.strategy.refusal("fused-non-adam", spec)
    if why is None or getattr(optimizer, "implementation", None) != "fused" or optimizer.name not in ("sgd", "adagrad"):
        return []
    return [Problem(key="recipe.optimizer.implementation", value="fused",
                    message=f"fused {optimizer.name} cannot run under strategy {spec.strategy.name}: {why}")]


_STATE_AT_BUILD = ("adagrad",)  # torch optimizers whose __init__ makes per-parameter state


def _state_at_build(spec: Any, loaded: Any) -> list[Problem]:
    """An optimizer that makes state when it is built, under a strategy whose ranks cannot hold it then (fsdp's
    ``init_from=rank0``). A recipe that builds its own optimizer is checked when the strategy prepares it."""
    name = getattr(getattr(loaded.config, "optimizer", None), "name", None)
    why = spec.strategy.refusal("state-at-build", spec) if name in _STATE_AT_BUILD else None
    if why is None:
        return []
    return [Problem(key="recipe.optimizer.name", value=name,
                    message=f"{name} makes its state when it is built: strategy {spec.strategy.name} cannot run it "
                    f"here ({why})")]
