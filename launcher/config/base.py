"""What every part of the run spec shares: strict models, common field types, the cross-field error."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

PositiveInt = Annotated[int, Field(gt=0)]
Port = Annotated[int, Field(ge=0, le=65535)]


class Strict(BaseModel):
    # strict: `true` is not a step count and "1" is not a bool; Hydra already types CLI values.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class PlanError(ValueError):
    """A cross-field rule failed; ``key`` names the config key to change."""

    def __init__(self, key: str, value: Any, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.value, self.message = key, value, message


class PlanErrors(ValueError):
    """Several cross-field rules failed, each independently of the others."""

    def __init__(self, errors: list[PlanError]):
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = errors


def check_rules(rules: Any, *args: Any) -> None:
    """Run every rule and raise all their ``PlanError``s together.

    A rule that fails otherwise after an earlier one failed relies on what that one checks: it is left out.
    """
    errors: list[PlanError] = []
    for rule in rules:
        try:
            rule(*args)
        except PlanError as exc:
            errors.append(exc)
        except PlanErrors as exc:  # a rule that names several problems at once
            errors.extend(exc.errors)
        except Exception:
            if not errors:
                raise
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise PlanErrors(errors)


def passes(rules: Any, *args: Any) -> bool:
    """Whether every rule holds (their problems are ``check_rules``' to report)."""
    try:
        check_rules(rules, *args)
    except (PlanError, PlanErrors):
        return False
    return True
