"""Task-list overrides (``cluster=tasks``) rewritten into what Hydra composes as the user meant them."""

from __future__ import annotations

from hydra.core.override_parser.overrides_parser import OverridesParser

from launcher.config.overrides import key_of

TASK_ROLES = ("chief", "worker", "ps")


def one_task(overrides: list[str]) -> list[str]:
    """``cluster.task.type=worker cluster.task.index=1`` as ``cluster.task={type: worker, index: 1}``: the ``tasks``
    option's ``task`` is null until a machine says which task it is, so Hydra knows no key under it."""
    given = [o for o in overrides if key_of(o) in ("cluster.task.type", "cluster.task.index") and o[:1] not in "+~"]
    if not given or any(_swept(o) for o in given):  # a sweep over them: Hydra's own words
        return overrides
    parts = {key_of(o).rpartition(".")[2]: o for o in given}  # the last of each, as Hydra takes it
    fields = ", ".join(f"{name}: {parts[name].partition('=')[2]}" for name in ("type", "index") if name in parts)
    first = overrides.index(given[0])
    return [*(o for o in overrides[:first]), f"cluster.task={{{fields}}}", *(o for o in overrides[first:] if o not in given)]


def _swept(override: str) -> bool:
    try:
        (ov,) = OverridesParser.create().parse_overrides([override])
    except Exception:  # noqa: BLE001 - its own problem is named where it always was
        return True
    return ov.is_sweep_override()


def whole_task_lists(overrides: list[str]) -> list[str]:
    """``cluster.tasks={worker: [A, B]}`` is the whole task list, as a TF_CONFIG's cluster is: the roles it leaves out
    are empty (``{chief: [], ps: [], worker: [A, B]}``), not the ``cluster=tasks`` option's own demo chief, which
    Hydra's merge of a mapping would keep (a third node). One override in, one out."""
    out = []
    for o in overrides:
        if key_of(o) == "cluster.tasks" and (o[:1] not in "+~" or o[:2] == "++") and o.partition("=")[2].lstrip().startswith("{"):
            try:
                (ov,) = OverridesParser.create().parse_overrides([o])
                value = ov.value()
            except Exception:  # noqa: BLE001 - its own problem is named where it always was
                value = None
            if isinstance(value, dict) and not ov.is_sweep_override():
                missing = [role for role in TASK_ROLES if role not in value]
                key, _, text = o.partition("=")
                at = text.index("{") + 1
                empty = ", ".join(f"{role}: []" for role in missing) + (", " if value else "")
                o = f"{key}={text[:at]}{empty}{text[at:]}" if missing else o
        out.append(o)
    return out
