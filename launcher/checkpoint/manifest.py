"""What a checkpoint records about the run that wrote it, and what changed since.

``manifest.json`` (plain JSON, written last) holds the step, the data position,
the world size, strategy, mesh, batch sizes, input partitioning and the recipe
settings. Resuming compares it with the new run: a different recipe is an
error; a different world size, batch split or data partitioning is shown in
the plan and the run continues (DCP reshards the saved tensors).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from launcher.checkpoint.errors import CheckpointError
from launcher.config.errors import spelled
from launcher.config.schema import RunSpec
from launcher.input.auto_shard import resolve_policy
from launcher.input.position import Position

FORMAT = 1


def build(spec: RunSpec, step: int, position: Position) -> dict[str, Any]:
    n = spec.num_replicas
    return {
        "format": FORMAT,
        "step": step,
        "data_position": position.as_dict(),
        "world_size": spec.num_processes,
        "num_replicas": n,
        "strategy": spec.strategy.name,
        "cluster": spec.cluster.shape,
        "mesh": {"dims": ["replica"], "shape": [n]},
        "global_batch_size": spec.input.global_batch_size,
        "per_replica_batch_size": spec.per_replica_batch_size,
        "input": _input_layout(spec),
        "recipe": spec.recipe.model_dump(mode="json"),
        "trainer_seed": spec.trainer.seed,
        "trainer": _how_steps_train(spec),
        "lr_decay": _lr_decay(spec),
        "torch": torch.__version__,
        "time": time.time(),
    }


def _input_layout(spec: RunSpec) -> dict[str, Any]:
    inp = spec.input
    policy = resolve_policy(inp.policy, len(inp.files), spec.num_processes).value if inp.files else None
    return {"files": len(inp.files), "policy": policy, "workers": spec.num_processes, "seed": spec.input_seed, "shuffle": inp.shuffle}


def check_compatible(manifest: dict[str, Any], spec: RunSpec, where: str) -> None:
    """Raise ``CheckpointError`` when the checkpoint belongs to another kind of run."""
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where} has manifest format {manifest.get('format')!r}; this dlaunch reads format {FORMAT}")
    saved = manifest.get("recipe", {}).get("name")
    if saved != spec.recipe.name:
        raise CheckpointError(
            f"{where} was saved by recipe {saved}, but this run's recipe is {spec.recipe.name}; "
            "resume it with the same recipe, or start afresh with trainer.resume=never"
        )


def changes(manifest: dict[str, Any], spec: RunSpec) -> list[str]:
    """What differs between the run that saved ``manifest`` and ``spec``, in words."""
    out = []
    old_world, new_world = manifest["world_size"], spec.num_processes
    if old_world != new_world:
        out.append(f"world size {old_world} -> {new_world} (DCP reshards the saved state)")
    if manifest["strategy"] != spec.strategy.name:
        out.append(f"strategy {manifest['strategy']} -> {spec.strategy.name}")
    if manifest["per_replica_batch_size"] != spec.per_replica_batch_size:
        old_n, new_n = manifest["num_replicas"], spec.num_replicas
        out.append(f"per-replica batch {manifest['per_replica_batch_size']} -> {spec.per_replica_batch_size} "
                   + (f"({old_n} -> {new_n} replicas)" if old_n != new_n else f"(on {new_n} replica(s))"))
    if manifest["global_batch_size"] != spec.input.global_batch_size:
        out.append(f"global batch {manifest['global_batch_size']} -> {spec.input.global_batch_size}: the data position "
                   f"(epoch {manifest['data_position']['epoch']}, batch {manifest['data_position']['offset']}) now counts other batches")
    out += _data_changes(manifest["input"], _input_layout(spec))
    out += [f"recipe.{key}: {old} -> {new}" for key, old, new in recipe_diff(manifest.get("recipe", {}), spec)]
    if "trainer" in manifest:  # checkpoints before this record none
        out += [f"trainer.{key}: {spelled(old)} -> {spelled(new)}" for key, old, new in _diff(manifest["trainer"], _how_steps_train(spec))]
    old_decay, new_decay = manifest.get("lr_decay"), _lr_decay(spec)  # checkpoints before this record none
    if old_decay and new_decay and old_decay != new_decay:
        fits = spec.trainer.lr_schedule.warmup_steps + old_decay["steps"] <= spec.trainer.steps
        keep = (f" (trainer.lr_schedule.decay_steps={old_decay['steps']} keeps the saved length; the steps after it run "
                "at min_lr_ratio x lr)") if fits else ""
        out.append(f"lr schedule: {old_decay['decay']} decay over {old_decay['steps']} -> {new_decay['decay']} over "
                   f"{new_decay['steps']} steps after the warm-up: from step {manifest['step']} the lr is the new schedule's{keep}")
    return out


def recipe_diff(saved: dict[str, Any], spec: RunSpec) -> list[tuple[str, Any, Any]]:
    """Both recipe sections as the recipe's ``Config`` reads them: a key one YAML leaves at its default and the other
    sets to that same value is no change."""
    from launcher.runtime.recipe import as_read

    new = spec.recipe.model_dump(mode="json")
    if spec.script is not None:
        return _diff(saved, new)
    return _diff(as_read(saved), as_read(new))


def _how_steps_train(spec: RunSpec) -> dict[str, Any]:
    """The trainer settings that change what a step does (not how long the run is, or what it logs)."""
    t = spec.trainer
    return {"precision": t.precision, "grad_accum_steps": t.grad_accum_steps, "clip_grad_norm": t.clip_grad_norm,
            "compile": t.compile.model_dump(mode="json"), "lr_schedule": t.lr_schedule.model_dump(mode="json")}


def _lr_decay(spec: RunSpec) -> dict[str, Any] | None:
    """The schedule's decay and its length in steps (None: no decay); a longer ``trainer.steps`` stretches it."""
    schedule = spec.trainer.lr_schedule
    if schedule.decay == "constant":
        return None
    return {"decay": schedule.decay, "steps": schedule.decay_length(spec.trainer.steps)}


def _data_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    if old["seed"] != new["seed"] or old["shuffle"] != new["shuffle"]:
        return [f"data order: seed {old['seed']} shuffle {old['shuffle']} -> seed {new['seed']} shuffle {new['shuffle']}"]
    if old["workers"] == new["workers"]:
        return []
    if new["files"] and (old["policy"] == "FILE" or new["policy"] == "FILE"):
        return [f"data re-partitioned: {old['policy']} over {old['workers']} worker(s) -> {new['policy']} over "
                f"{new['workers']}; the epoch continues at the same step with the new shards"]
    return [f"data re-partitioned: each global batch is split among {new['workers']} worker(s) instead of "
            f"{old['workers']}; the global batches are the same"]


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append((f"{prefix}{key}", a, b))
    return out
