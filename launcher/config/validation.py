"""Validate a composed config into a ``RunSpec``: every problem found in one ``ConfigError``.

The schema's fields, its cross-field rules and the recipe's own ``Config`` are checked together wherever they
are independent; so are interpolations that do not resolve (``trainer.steps=${nope}``).
"""

from __future__ import annotations

import copy
import dataclasses

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError

from launcher.config import pydantic_errors, recipe_rules, user_recipes
from launcher.config import script as script_config
from launcher.config.errors import ConfigError, Problem, UserCodeError
from launcher.config.overrides import key_of
from launcher.config.schema import RunSpec
from launcher.runtime import recipe as recipe_lib


def validate(cfg: DictConfig, cuda_devices: int, overrides: list[str] | None = None, found: bool = False) -> RunSpec:
    """The composed config as a ``RunSpec``, or a ``ConfigError`` listing every problem.

    The schema's field errors, the cross-field rules and the recipe's own ``Config`` are checked together
    wherever they are independent, so that one run shows every mistake. Checking the recipe's keys means
    importing it (and so torch: seconds): when the rest already has problems and the command line
    (``overrides``) touches no ``recipe`` key, those problems are reported at once without it. ``found``: the
    caller has problems to report already (unknown keys), so the rest counts as having some.
    """
    data, unresolved, deferred = _resolved(cfg)
    data.pop("hydra", None)
    script_config.apply(data)
    # the parent looks at the input files once (workers need not), and at this machine's addresses
    context = {"cuda_devices": cuda_devices, "check_files": True, "here": True}
    spec, problems = None, []
    try:
        spec = RunSpec.model_validate(data, context=context)
    except ValidationError as exc:
        problems = pydantic_errors.problems(exc, RunSpec, data)
        problems += _rules_without(data, problems, context)
    if unresolved or deferred:  # the keys that did not resolve took their defaults: what pydantic says of those is no news
        problems = [*unresolved, *(p for p in problems if not _related(p.key, [u.key for u in unresolved] + deferred))]
    recipe = data.get("recipe")
    # a script is not imported here: it runs (once per worker) as __main__
    is_recipe = data.get("script") is None and isinstance(recipe, dict) and isinstance(recipe.get("entry"), str)
    quick = (bool(problems) or found) and overrides is not None and not any(key_of(o).startswith("recipe") for o in overrides)
    loaded = _recipe_problems(recipe, problems) if is_recipe and not quick else None
    if problems and loaded is not None:
        problems += _recipe_rules_without(data, problems, context, loaded)
    if problems:
        raise ConfigError(_named_with_their_yaml(problems, recipe, overrides))
    if loaded is not None:
        recipe_rules.check(spec, loaded)
    spec._deferred = tuple(deferred)
    return spec


def _named_with_their_yaml(problems: list[Problem], recipe: object, overrides: list[str] | None) -> list[Problem]:
    """A key at fault (unknown, of the wrong type, out of range) that a user recipe's YAML sets and the command line
    did not type: say which file."""
    entry = recipe.get("entry") if isinstance(recipe, dict) else None
    problems = _kept_by_entry(problems, recipe, entry, overrides)
    yaml_path = user_recipes.YAMLS.get(entry) if isinstance(entry, str) else None
    if yaml_path is None:
        return problems
    try:
        text = OmegaConf.load(yaml_path)
    except Exception:  # noqa: BLE001 - read once already (user_recipes); changed since: the problems as they are
        return problems
    typed = {key_of(o) for o in overrides or ()}

    def in_file(p: Problem) -> bool:  # a value typed over the file's (the run's overrides are not always known) is not
        found = OmegaConf.select(text, p.key, default=None)
        shown = [str(p.value)] + ([str(p.value[0])] if isinstance(p.value, list) and len(p.value) == 1 else [])
        return found is not None and (p.message.startswith("unknown key") or str(found) in shown)  # input.files: a list

    return [dataclasses.replace(p, message=f"{p.message}, set in {yaml_path}") if p.key not in typed and in_file(p)
            else p for p in problems]


def _kept_by_entry(problems: list[Problem], recipe: object, entry: object, overrides: list[str] | None) -> list[Problem]:
    """``recipe.entry=my.py`` typed without ``recipe=``: the selected recipe's YAML (the default, linear) still sets its
    keys, which the new code's Config does not know. Each such unknown key says where it came from, and the fix."""
    typed = {key_of(o) for o in overrides or ()}
    if "recipe.entry" not in typed or "recipe" in typed or not isinstance(recipe, dict):
        return problems
    how = f"recipe={entry}" if str(entry).endswith(".py") else "recipe=NAME"
    said = f", the {recipe.get('name') or 'selected'} recipe's (recipe.entry keeps its settings; `{how}` brings the file's own)"
    return [dataclasses.replace(p, message=p.message + said)
            if p.key.startswith("recipe.") and p.key not in typed and p.message.startswith("unknown key") else p
            for p in problems]


_FOUND_ON_DISK = ("script.path",)  # keys judged by the disk alone, which the later rounds do not look at again


def _rules_without(data: dict, problems: list[Problem], context: dict) -> list[Problem]:
    """The cross-field rules' problems once the keys already at fault take their defaults (pydantic skips the rules then).

    A rule about a key at fault would judge its default, not the user's value: such problems are left out. Each
    round drops the keys found at fault so far, so that the rules after them run too; a default that is itself
    refused (a profile window of the default length against a short run) drops its section.
    """
    # a script that is not there is still a script: the keys a script is refused are judged as for one
    dropped, found = [p.key for p in problems if p.key not in _FOUND_ON_DISK], []
    context = {**context, "check_files": False}  # the files were looked at once: their problems are found already
    for _ in range(8):
        try:
            RunSpec.model_validate(_without(data, dropped), context=context)
            return found
        except ValidationError as exc:
            new = pydantic_errors.plan_problems(exc)
        fresh = [p for p in new if not _related(p.key, dropped) and p not in found and p.key not in _FOUND_ON_DISK]
        found += fresh
        more = [p.key for p in fresh] + [p.key.rpartition(".")[0] for p in new if _related(p.key, dropped)]
        more = [k for k in dict.fromkeys(more) if k and k not in dropped]
        if not more:
            return found
        dropped += more
    return found


def _without(data: dict, keys: list[str]) -> dict:
    pruned = copy.deepcopy(data)
    for key in keys:
        *parents, last = key.split(".")
        node = pruned
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return pruned


def _recipe_rules_without(data: dict, problems: list[Problem], context: dict, loaded: recipe_lib.LoadedRecipe) -> list[Problem]:
    """The rules between the run and its recipe's code (recipe_rules), judged with the keys at fault at their defaults:
    what they find about other keys belongs on the same screen."""
    bad = [p.key for p in problems]
    try:
        recipe_rules.check(RunSpec.model_validate(_without(data, bad), context={**context, "check_files": False}), loaded)
    except ValidationError:  # a default that is refused too: the problems already found stand alone
        return []
    except ConfigError as exc:
        return [p for p in exc.problems if not _related(p.key, bad)]
    return []


def _recipe_problems(recipe: dict, problems: list[Problem]) -> recipe_lib.LoadedRecipe | None:
    """The loaded recipe (None if it is at fault: its problems are added to ``problems``). Where only its ``Config``
    refuses some keys, the recipe loaded with those at their defaults, for the rules between it and the run.

    An exception raised by the recipe's own code at import is no config problem: ``UserCodeError``, exit 1, where
    it is the only problem; beside config problems it is one of them, so that one screen names every one.
    """
    try:
        return recipe_lib.load(recipe)
    except recipe_lib.RecipeError as exc:
        problem = Problem(key=exc.key, value=exc.value, message=exc.message)
        if exc.in_user_code and not problems:
            raise UserCodeError([problem]) from None
        problems.append(problem)
    except ValidationError as exc:
        config_cls = recipe_lib.config_class(recipe_lib.import_entry(recipe["entry"]), recipe["entry"])
        refused = pydantic_errors.problems(exc, config_cls, recipe, prefix=("recipe",))
        problems += [p for p in refused if p not in problems]
        try:
            return recipe_lib.load(_without(recipe, [p.key.removeprefix("recipe.") for p in refused]))
        except (recipe_lib.RecipeError, ValidationError):
            return None
    return None


# a key at fault, and the keys whose rules read it too: with its default in its place they would judge the default
# (a task list gives the cluster's whole layout; a node rank decides where the rendezvous listens; a batch is what
# accumulation splits)
_READ_WITH = {"cluster.tasks": ("cluster",), "cluster.task": ("cluster",), "cluster.node_rank": ("cluster.master_addr",),
              "input.global_batch_size": ("trainer.grad_accum_steps",)}


def _related(key: str, bad: list[str]) -> bool:
    """``key`` is one of ``bad``, under one, or holds one; or a rule about it reads one (``_READ_WITH``)."""
    bad = [*bad, *(k for b in bad for prefix, keys in _READ_WITH.items() if b.startswith(prefix) for k in keys)]
    return any(key == b or key.startswith(b + ".") or b.startswith(key + ".") for b in bad)


def _resolved(cfg: DictConfig) -> tuple[dict, list[Problem], list[str]]:
    """``cfg`` as a plain dict, with a problem for each key whose interpolation fails; those keys are left out
    (their defaults stand), so that the rest is still checked. Keys that interpolate Hydra's own config
    (``${hydra:runtime.output_dir}``) resolve only inside Hydra's job: left out too, and named (third item)."""
    problems: list[Problem] = []
    deferred: list[str] = []
    while True:
        try:
            return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True), problems, deferred
        except OmegaConfBaseException as exc:
            key = str(getattr(exc, "full_key", None) or "")
            if "HydraConfig was not set" in str(exc) and key:
                deferred.append(key)
            else:
                problems.append(Problem(key=key or "config", message=str(exc).splitlines()[0], has_value=False))
            if len(problems) + len(deferred) == 1:
                cfg = copy.deepcopy(cfg)  # the caller's config stays whole
            parent_key, _, last = key.rpartition(".")
            parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
            if not key or len(problems) + len(deferred) > 20 or not isinstance(parent, DictConfig) or last not in parent:
                raise ConfigError(problems or [Problem(key=key or "config", message=str(exc).splitlines()[0], has_value=False)]) from None
            with open_dict(parent):
                del parent[last]
