"""Turn pydantic's validation errors into ``Problem``s with dotted keys and suggestions."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from launcher.config.errors import Problem, did_you_mean, spelled
from launcher.config.base import PlanError, PlanErrors


def problems(exc: ValidationError, root: type[BaseModel], data: Any, prefix: tuple[str, ...] = ()) -> list[Problem]:
    out = []
    for err in exc.errors():
        several = err.get("ctx", {}).get("error")
        if isinstance(several, PlanErrors):  # every cross-field rule that failed, one problem each
            out += [Problem(key=e.key, value=e.value, message=e.message) for e in several.errors]
            continue
        path, parent_model, parent_data = _walk(root, data, err["loc"])
        problem = _problem(err, (*prefix, *path), parent_model, parent_data)
        out += _leaves(problem, parent_model) if err["type"] == "extra_forbidden" else [problem]
    return _strategy_renamed(out, data.get("strategy") if isinstance(data, dict) and not prefix else None)


def _strategy_renamed(out: list[Problem], strategy: Any) -> list[Problem]:
    """``strategy.name: mirrored`` in a YAML (or ``strategy.name=mirrored``) over the group's default, one_device:
    one_device's keys, at their defaults, are unknown to mirrored. One problem saying so, not one per key."""
    name = strategy.get("name") if isinstance(strategy, dict) else None
    unknown = {p.key.split(".", 1)[1]: p for p in out if p.key.count(".") == 1 and p.key.startswith("strategy.")
               and p.message == "unknown key"}
    if not unknown or not isinstance(name, str):
        return out
    from launcher import strategies

    for other, unit in strategies.units().items():
        defaults = unit.model_construct().model_dump(mode="json")
        if other != name and all(k in defaults and defaults[k] == strategy[k] for k in unknown):
            said = Problem(key="strategy.name", value=name, allowed=tuple(strategies.units()), message=(
                f"names strategy {name} over strategy {other}'s settings ({', '.join(unknown)}), the strategy group's "
                f"choice: strategy.name does not choose a strategy; choose it as a group: strategy={name} on the command "
                f"line, or `- override /strategy: {name}` in your config's defaults list"))
            return [said, *(p for p in out if p not in unknown.values())]
    return out


def _leaves(problem: Problem, parent: type[BaseModel] | None) -> list[Problem]:
    """An unknown section (``recipe.optimizr.lr=0.1`` gives ``optimizr: {lr: 0.1}``) as one problem per key typed,
    each with its full key; where the suggested field is a section too, the suggestion goes on to the same key:
    ``did you mean recipe.optimizer.lr``."""
    if not isinstance(problem.value, dict) or not problem.value:
        return [problem]
    guessed = parent.model_fields.get(problem.suggestion.rpartition(".")[2]) if parent and problem.suggestion else None
    section = guessed is not None and bool(_models(guessed.annotation))
    out = []
    for suffix, value in _flat(problem.value):
        guess = f"{problem.suggestion}.{suffix}" if section else problem.suggestion
        out.append(Problem(key=f"{problem.key}.{suffix}", value=value, message=problem.message, allowed=problem.allowed,
                           suggestion=guess))
    return out


def _flat(section: dict, head: str = "") -> list[tuple[str, Any]]:
    pairs: list[tuple[str, Any]] = []
    for k, v in section.items():
        key = f"{head}{k}"
        pairs += _flat(v, f"{key}.") if isinstance(v, dict) and v else [(key, v)]
    return pairs


def plan_problems(exc: ValidationError) -> list[Problem]:
    """Only the problems that cross-field rules (``PlanError``) found."""
    errors = [err["ctx"]["error"] for err in exc.errors() if isinstance(err.get("ctx", {}).get("error"), (PlanError, PlanErrors))]
    flat = [e for err in errors for e in (err.errors if isinstance(err, PlanErrors) else [err])]
    return [Problem(key=e.key, value=e.value, message=e.message) for e in flat]


def _walk(model: type[BaseModel] | None, data: Any, loc: tuple) -> tuple[list[str], type[BaseModel] | None, Any]:
    """The dotted path of ``loc`` without union tags, and the model holding its last key."""
    path: list[str] = []
    parent, parent_data = model, data
    items = list(loc)
    while items:
        part = items.pop(0)
        if not isinstance(part, str):
            path.append(str(part))
            parent = None
            continue
        path.append(part)
        if not items:
            break
        field = parent.model_fields.get(part) if parent else None
        child_data = parent_data.get(part) if isinstance(parent_data, dict) else None
        child = _model_for(field.annotation, child_data) if field else None
        if child is not None and items and _is_tag(field.annotation, items[0]):
            items.pop(0)  # pydantic puts the union's tag in the location: drop it
        parent, parent_data = child, child_data
    return path, parent, parent_data


def annotation_members(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return annotation_members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in annotation_members(a)]
    return [annotation]


def _models(annotation: Any) -> list[type[BaseModel]]:
    return [m for m in annotation_members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]


def _tag_of(model: type[BaseModel]) -> str | None:
    field = model.model_fields.get("name")
    args = typing.get_args(field.annotation) if field else ()
    return args[0] if field and typing.get_origin(field.annotation) is typing.Literal else None


def _is_tag(annotation: Any, part: Any) -> bool:
    models = _models(annotation)
    return len(models) > 1 and part in {_tag_of(m) for m in models}


def _model_for(annotation: Any, data: Any) -> type[BaseModel] | None:
    models = _models(annotation)
    if len(models) == 1:
        return models[0]
    name = data.get("name") if isinstance(data, dict) else None
    return next((m for m in models if _tag_of(m) == name), None)


def _problem(err: dict, path: tuple[str, ...], parent: type[BaseModel] | None, parent_data: Any) -> Problem:
    key = ".".join(path) or "config"
    kind = err["type"]
    fields = tuple(parent.model_fields) if parent else ()
    if kind == "extra_forbidden":
        guess = did_you_mean(path[-1], fields) or _in_a_section(path[-1], parent)
        suggestion = ".".join((*path[:-1], guess)) if guess else None
        return Problem(key=key, value=err.get("input"), message="unknown key", allowed=fields, suggestion=suggestion)
    if kind == "missing":
        return Problem(key=key, message="required key is missing", has_value=False)
    if kind == "union_tag_invalid":
        tags = tuple(str(t).strip("'") for t in str(err.get("ctx", {}).get("expected_tags", "")).split(", ") if t)
        value = err.get("ctx", {}).get("tag")
        return Problem(key=f"{key}.name", value=value, message="unknown strategy", allowed=tags, suggestion=did_you_mean(value, tags))
    if kind == "value_error" and isinstance(err.get("ctx", {}).get("error"), PlanError):
        plan = err["ctx"]["error"]
        return Problem(key=plan.key, value=plan.value, message=plan.message)
    if kind == "literal_error":
        expected = str(err.get("ctx", {}).get("expected", ""))
        allowed = tuple(v.strip(" '") for v in expected.replace(" or ", ", ").split(",") if v.strip())
        return Problem(key=key, value=err.get("input"), message="not an allowed value", allowed=allowed,
                       suggestion=did_you_mean(str(err.get("input")), allowed))
    message = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    if kind == "string_type" and (value is None or isinstance(value, (bool, int, float))):  # Hydra typed the text
        typed = spelled(value)
        what = "no value" if value is None else {bool: "a boolean", int: "an integer"}.get(type(value), "a number")
        message += (f": {typed} reads as {what}; quote it to mean the text ('{key}=\"{typed}\"' on the command line, "
                    f"\"{typed}\" in YAML)")
    field = parent.model_fields.get(path[-1]) if parent and path else None
    section = _models(field.annotation) if field else []
    if kind in ("model_type", "dict_type") and len(section) == 1 and not isinstance(value, dict):  # a value for a section
        keys = tuple(section[0].model_fields)
        return Problem(key=key, value=value, allowed=keys, message=f"{key} is a section, not a value: set its keys "
                       f"({key}.KEY=VALUE on the command line)", suggestion=_closest_key(key, value, section[0]))
    if kind == "list_type" and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        low, _ = _list_length(field)
        message += f"; a list of one: {key}=[{spelled(value)}]" if low <= 1 else f"; give a list, e.g. {_list_example(key, field)}"
    elif kind in ("too_short", "too_long") and isinstance(value, list) and field is not None:
        message += f"; e.g. {_list_example(key, field)}"
    if kind == "value_error" and isinstance(value, dict):  # a rule over a section's keys: its words name them
        return Problem(key=key, message=message, has_value=False)
    if kind in ("int_type", "int_parsing", "int_from_float", "float_type", "float_parsing") and _bounds(field):
        message += f" {_bounds(field)}"  # trainer.steps=null: what it takes, as a value out of range is told
    return Problem(key=key, value=value, message=message)


def _bounds(field: Any) -> str:
    """A number field's range as pydantic says it: ``greater than 0``, ``greater than or equal to 0 and less than 1``."""
    said = {"gt": "greater than", "ge": "greater than or equal to", "lt": "less than", "le": "less than or equal to"}
    parts = [f"{words} {getattr(m, name)}" for m in getattr(field, "metadata", ()) for name, words in said.items()
             if getattr(m, name, None) is not None]
    return " and ".join(parts)


def _list_length(field: Any) -> tuple[int, int | None]:
    """The fewest and the most items a list field takes (pydantic's min_length and max_length)."""
    low = max((m.min_length for m in getattr(field, "metadata", ()) if hasattr(m, "min_length")), default=0)
    high = min((m.max_length for m in getattr(field, "metadata", ()) if hasattr(m, "max_length")), default=None)
    return low, high


def _list_example(key: str, field: Any) -> str:
    """``recipe.optimizer.betas=[0.9,0.999] (its default; 2 items)``: how a list of the right length is written."""
    low, high = _list_length(field)
    count = f"{low} item{'s' * (low != 1)}" if low == high else f"{low} to {high} items" if high else f"at least {low} item{'s' * (low != 1)}"
    try:
        default = field.get_default(call_default_factory=True) if field is not None else None
    except Exception:  # noqa: BLE001 - a factory that needs the validated data: no example from it
        default = None
    if isinstance(default, list) and default:
        return f"{key}=[{','.join(spelled(v) for v in default)}] (its default; {count})"
    return f"{key}=[A,B] ({count})"


def _in_a_section(name: str, parent: type[BaseModel] | None) -> str | None:
    """``trainer.warmup_steps``: the section of ``parent`` that has the key (``lr_schedule.warmup_steps``)."""
    for field_name, field in (parent.model_fields.items() if parent else ()):
        models = _models(field.annotation)
        if len(models) == 1 and name in models[0].model_fields:
            return f"{field_name}.{name}"
    return None


def _closest_key(key: str, value: Any, section: type[BaseModel]) -> str | None:
    """For ``trainer.lr_schedule=cosine``: the section's key whose allowed values hold it (``decay``); else its first
    key of the value's type (``trainer.checkpoint=20``: ``every_steps``)."""
    def holds(f: Any) -> bool:
        return any(typing.get_origin(m) is typing.Literal and value in typing.get_args(m) for m in annotation_members(f.annotation))

    fields = section.model_fields
    name = next((n for n, f in fields.items() if holds(f)), None)
    name = name or next((n for n, f in fields.items() if type(value) in annotation_members(f.annotation)), None)
    return f"{key}.{name}={spelled(value)}" if name else None
