"""The one error an RLJob manifest is refused with: every problem, each with its field path, so
``rljob plan`` and the operator's Valid condition say the same thing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class PlanError(ValueError):
    """Every problem found in one manifest."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))
