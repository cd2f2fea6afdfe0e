"""An override whose key the composed config lacks: the key it most likely meant.

Users arrive with other tools' habits (``lr=``, ``steps=``, ``trainer.batch_size=``), so the guess looks past
the key's own section: a typo of a sibling (``trainer.stpes``) first, then the same name one section down
(``trainer.warmup_steps``: ``trainer.lr_schedule.warmup_steps``), then the same name anywhere
(``trainer.lr``: ``recipe.optimizer.lr``), then a sibling spelled like it, then a name anywhere spelled like it
(``trainer.batch_size``: ``input.global_batch_size``).
"""

from __future__ import annotations

import difflib
from typing import Any, Iterator

from omegaconf import DictConfig

from launcher.config.errors import Problem, did_you_mean

TYPO = 0.8  # a sibling this close in spelling (difflib's ratio) was mistyped, whatever exists elsewhere
MAX_GUESSES = 3


def unknown_key_problem(tree: DictConfig, dotted: str, value: Any) -> Problem | None:
    """None if ``dotted`` exists in ``tree``; otherwise a problem naming the nearest key."""
    parts = dotted.split(".")
    node: Any = tree
    for i, part in enumerate(parts):
        if isinstance(node, DictConfig) and part in node:
            node = node[part]
            continue
        siblings = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        prefix = ".".join(parts[:i])
        return Problem(
            key=dotted, value=value, message=f"unknown key{f' under {prefix}' if prefix else ''}{_owners(parts, i)}",
            allowed=tuple(s for s in siblings if s != "hydra"), suggestion=_guess(tree, node, parts, i, siblings),
        )
    return None


def _owners(parts: list[str], i: int) -> str:
    """`` (a key of strategy=mirrored, multi_worker_mirrored)``: a setting of other strategies than the chosen one."""
    if parts[:i] != ["strategy"]:
        return ""
    from launcher import strategies

    owners = [name for name, unit in strategies.units().items() if parts[i] in unit.model_fields]
    return f" (a key of strategy={', '.join(owners)})" if owners else ""


def _guess(tree: DictConfig, node: Any, parts: list[str], i: int, siblings: list[str]) -> str | None:
    part, rest = parts[i], parts[i + 1:]
    sibling = did_you_mean(part, siblings)
    as_sibling = ".".join([*parts[:i], sibling, *rest]) if sibling else None
    if sibling and difflib.SequenceMatcher(None, part, sibling).ratio() >= TYPO:
        return as_sibling
    below = _in_a_section(node, siblings, part)
    if below:
        return " or ".join(".".join([*parts[:i], section, *parts[i:]]) for section in below[:MAX_GUESSES])
    anywhere = [".".join(p) for p in _paths(tree) if p[-len(parts) + i:] == parts[i:]]
    if anywhere or as_sibling:
        return " or ".join(anywhere[:MAX_GUESSES]) if anywhere else as_sibling
    if rest:
        return None
    near = did_you_mean(part, {p[-1] for p in _paths(tree)})
    return " or ".join([".".join(p) for p in _paths(tree) if p[-1] == near][:MAX_GUESSES]) or None


def _in_a_section(node: Any, keys: list[str], part: str) -> list[str]:
    """``trainer.warmup_steps``: the sections under ``node`` that have the key (``lr_schedule``)."""
    return [key for key in keys if key != "hydra" and isinstance(child := node._get_node(key), DictConfig)
            and part in child.keys()]  # _get_node: a leaf's interpolation is not resolved; keys(): a ??? one too


def _paths(tree: DictConfig) -> Iterator[list[str]]:
    """Every key's path in ``tree`` (Hydra's own section left out), breadth first: the shortest first."""
    level: list[tuple[list[str], DictConfig]] = [([], tree)]
    while level:
        deeper = []
        for path, node in level:
            for key in map(str, node.keys()):
                if key == "hydra":
                    continue
                child = node._get_node(key)
                yield [*path, key]
                if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
                    deeper.append(([*path, key], child))
        level = deeper
