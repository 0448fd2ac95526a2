"""Errors raised for bad backend strings.

Every problem is one ``AllocationError`` (a ``ValueError``): it names what is wrong,
the 1-based column it starts at (when it came from a string) and how to fix it, so
the CLI and the operator can print it as one line.
"""

from __future__ import annotations

from typing import TypeVar

_E = TypeVar("_E", bound="AllocationError")


class AllocationError(ValueError):
    """A backend string or allocation that cannot be used."""

    def __init__(
        self,
        problem: str,
        *,
        fix: str,
        field: str | None = None,
        spec: str | None = None,
        column: int | None = None,
    ) -> None:
        self.problem = problem
        self.fix = fix
        self.field = field  # the dimension or section at fault ("ep", "ffn.pp", ...); maps to a column
        self.spec = spec
        self.column = column
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ""
        if self.spec is not None:
            where = repr(shorten(self.spec))
            if self.column is not None:
                where += f", column {self.column}"
            where += ": "
        return f"{where}{self.problem}; fix: {self.fix}"

    def located(self: _E, spec: str, column: int | None) -> _E:
        """Place this error in ``spec`` (errors are fresh objects, so updating in place is safe)."""
        self.spec, self.column = spec, column
        self.args = (str(self),)
        return self


def shorten(text: str, limit: int = 60) -> str:
    """A long input quoted in one readable line (the column still counts in the whole string)."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


class AllocationSyntaxError(AllocationError):
    """The string does not follow ``backend:dims``."""


class MissingBackendError(AllocationSyntaxError):
    """Dimensions without a backend prefix (``d4t2``)."""


class AllocationValidationError(AllocationError):
    """The string parses but the parallel layout is not allowed."""


class LegacySpecError(AllocationError):
    """A multi-component (``a+b``, ``a|b``, ``[name]``) string from AReaL's old allocation mode."""

    def __init__(self, problem: str, *, fix: str, fields: list[tuple[str, str]], column: int | None = None) -> None:
        self.fields = fields  # (engine, backend string) pairs to write instead, e.g. ("actor", "fsdp:d4")
        super().__init__(problem, fix=fix, column=column)


class PlacementError(AllocationError):
    """An allocation that cannot be laid out on nodes of the given size."""
