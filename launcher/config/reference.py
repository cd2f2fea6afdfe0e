"""The configuration reference (docs/CONFIG.md), written from the pydantic schema itself.

``python -m launcher.config.reference > docs/CONFIG.md`` writes it again; a test
fails when the page and the schema disagree, so the reference is never stale.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import types
import typing
from typing import Any, Iterator, Literal, Union

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from launcher.config import schema
from launcher.runtime.recipe import OptimizerConfig

GROUPS = ("cluster", "trainer", "input", "launch", "sweep", "script")
HEADER = """# Configuration reference

Every key dlaunch accepts, with its type, its default and what it does. Set any
of them on the command line (`dlaunch trainer.steps=500`) or in a YAML file.
A recipe's YAML may change the defaults (`recipe=linear` trains 200 steps); see
the composed values with `dlaunch --cfg job`.

This page is written from the schema (`python -m launcher.config.reference >
docs/CONFIG.md`); `tests/config/test_reference.py` fails when they differ.
"""


def render() -> str:
    parts = [HEADER]
    parts += _section("strategy", None, "`strategy=NAME` picks one of these; its keys are `strategy.KEY`.")
    for spec in strategy_specs():
        parts += _section(f"strategy={strategy_name(spec)}", spec, prefix="strategy")
    for group in GROUPS:
        parts += _section(group, _model_in(schema.RunSpec.model_fields[group].annotation))
    parts += _section("recipe", schema.RecipeSpec, note=(
        "`recipe=NAME` picks a recipe. These keys every recipe has; the rest are the recipe's own "
        "(its `Config` class). Most recipes take `recipe.optimizer`:"))
    parts += _table(OptimizerConfig, "recipe.optimizer")
    return "\n".join(parts).rstrip() + "\n"


def strategy_specs() -> tuple[type[BaseModel], ...]:
    return typing.get_args(typing.get_args(schema.StrategySpec)[0])


def strategy_name(spec: type[BaseModel]) -> str:
    return typing.get_args(spec.model_fields["name"].annotation)[0]


def _section(title: str, model: type[BaseModel] | None, note: str = "", prefix: str | None = None) -> list[str]:
    lines = [f"## {title}", ""]
    doc = _first_paragraph(model) if model is not None else ""
    lines += [text for text in (doc, note) if text] and [" ".join(t for t in (doc, note) if t), ""]
    return lines + (_table(model, prefix or title) if model is not None else [])


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    rows = list(_rows(model, prefix))
    if not rows:
        return []
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{key}` | {kind} | {default} | {meaning} |" for key, kind, default, meaning in rows]
    return lines + [""]


def _rows(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, str, str, str]]:
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}"
        inner = _model_in(field.annotation)
        if name == "name" and prefix.startswith("strategy"):
            continue  # the group choice itself
        if inner is not None and inner is not model:
            yield from _rows(inner, key)
            continue
        yield key, _type_text(field.annotation, field), _default_text(field), _escape(field.description or "")


def _model_in(annotation: Any) -> type[BaseModel] | None:
    candidates = [a for a in (annotation, *_union_args(annotation)) if inspect.isclass(a) and issubclass(a, BaseModel)]
    return candidates[0] if candidates else None


def _union_args(annotation: Any) -> tuple[Any, ...]:
    return typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else ()


def _type_text(annotation: Any, field: FieldInfo | None = None) -> str:
    bounds = _bounds(field.metadata) if field is not None else ""
    return _escape(_base_type(annotation) + bounds)


def _base_type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _base_type(args[0]) + _bounds(args[1:])
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _base_type(a) for a in args)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_base_type(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {_base_type(args[0])} to {_base_type(args[1])}"
    if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
        return " | ".join(str(m.value) for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: Any) -> str:
    words = {Gt: "> {}", Ge: ">= {}", Lt: "< {}", Le: "<= {}", MinLen: "length >= {}", MaxLen: "length <= {}"}
    found = [text.format(getattr(item, dataclasses.fields(item)[0].name))
             for item in metadata for kind, text in words.items() if isinstance(item, kind)]
    found += [_bounds(item.metadata).strip(" ()") for item in metadata if isinstance(item, FieldInfo) and item.metadata]
    return f" ({', '.join(found)})" if found else ""


def _default_text(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, enum.Enum):
        value = value.value
    text = value if isinstance(value, str) else json.dumps(value)  # null, true, [], 0.5: as YAML writes them
    return f"`{text}`" if text else "`''`"


def _first_paragraph(model: type[BaseModel]) -> str:
    doc = inspect.getdoc(model) or ""
    if model.__doc__ is None or doc == inspect.getdoc(BaseModel):
        return ""
    return _escape(" ".join(doc.split("\n\n")[0].split()))


def _escape(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    print(render(), end="")
