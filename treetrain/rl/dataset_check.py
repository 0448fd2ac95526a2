"""Checks of a dataset's rows before the model loads, each failure one line naming the file, the
line (JSON lines, from 1) or row index (from 0) and the fix.

Text files are scanned before Hugging Face ``datasets`` sees them: an empty file, a line that is
not UTF-8 or not JSON, and a row nested past :data:`MAX_DEPTH` (pyarrow's JSON reader crashes the
process on a row nested 100,000 deep) are refused with the line number, which ``datasets`` would
only log. The rows of JSON files are checked as read (``datasets`` may re-encode a column whose
type changes between rows, hiding a bad value); Parquet, CSV and save_to_disk rows once loaded.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treetrain.rl.task import TaskError

ROLES = ("system", "user", "assistant")
MAX_DEPTH = 64  # nesting of a row's JSON; a list of {role, content} messages is 3 deep
BATCH_ROWS = 4096  # rows converted to Python at once when checking loaded rows
_BOM = b"\xef\xbb\xbf"
# A JSON string; an unterminated one runs to the end, so every match succeeds and the scan is
# linear (with the closing quote required, each later quote of a hostile line rescans the rest).
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_ONE_BRACKET = bytes.maketrans(b"{}", b"[]")


class DatasetError(TaskError):
    """A dataset that cannot be read or used; the message says what to change. A TaskError, so
    one raised at any step stops ``treetrain train`` with exit 2 and its one line."""


@dataclass(frozen=True)
class RowRules:
    """What a row must hold: ``prompt_field`` always; ``answer_field`` when ``answer_for`` (the
    reward that compares replies with the answer) is set."""

    key: str  # the config key of the dataset: trainer.dataset or trainer.eval.dataset
    path: str  # as the config gives it
    prompt_field: str
    answer_field: str
    answer_for: str | None

    @property
    def where(self) -> str:
        return f"{self.key} {self.path}"

    def fields(self) -> tuple[str, ...]:
        return (self.prompt_field, self.answer_field) if self.answer_for else (self.prompt_field,)

    def problem(self, row: Mapping[str, Any]) -> str | None:
        """What is wrong with one row (None: nothing). Called once a row: the common rows (a
        string prompt, a string answer) take the short way."""
        prompt = row.get(self.prompt_field)
        if type(prompt) is not str or not prompt or prompt.isspace():
            bad = prompt_problem(prompt, self.prompt_field)
            if bad is not None:
                return bad
        if self.answer_for is None:
            return None
        answer = row.get(self.answer_field)
        if type(answer) is str:
            return None
        if answer is None or (isinstance(answer, float) and math.isnan(answer)):
            return (
                f"no answer ({self.answer_field!r} is absent or null), and {self.answer_for} compares each reply "
                f"with it; fix: give every row an answer, or set {self.key}.answerField to the column that holds it"
            )
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            return (
                f"answer {self.answer_field!r} is {describe(answer)}, not a string or number ({self.answer_for} "
                "compares it as text); fix: write the answer as a string"
            )
        return None

    def missing_columns(self, columns: Iterable[str]) -> DatasetError | None:
        have = list(columns)
        missing = [f for f in self.fields() if f not in have]
        if not missing:
            return None
        return DatasetError(
            f"{self.where}: no column {', '.join(map(repr, missing))}; its columns are {', '.join(have) or 'none'}: "
            f"set {self.key}.promptField / answerField"
        )


def prompt_problem(prompt: Any, field_name: str) -> str | None:
    """Why ``prompt`` (column ``field_name``) is not a string or a non-empty list of {role, content}
    messages, with the fix (None: it is). A list read from a column of messages has every key of
    any message; the unset ones are None."""
    name = f"prompt {field_name!r}"
    if prompt is None:
        return f"no prompt ({field_name!r} is absent or null); fix: give every row a prompt, {_PROMPT_FORMS}"
    if isinstance(prompt, str):
        return f"{name} is an empty string; fix: write the prompt, or drop the row" if not prompt.strip() else None
    if not isinstance(prompt, list):
        return f"{name} is {describe(prompt)}; fix: make it {_PROMPT_FORMS}"
    if not prompt:
        return f"{name} is an empty list of messages; fix: give it at least one {{role, content}} message"
    for i, message in enumerate(prompt):
        if type(message) is dict and message.get("role") in ROLES and type(message.get("content")) is str:
            continue
        if not isinstance(message, dict):
            return f"{name} message {i} is {describe(message)}; fix: make each message {{role, content}}"
        role = message.get("role")
        if role not in ROLES:
            got = "no role" if role is None else f"role {str(role)[:40]!r}"
            return f"{name} message {i} has {got}; fix: a role is one of {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"{name} message {i} ({role}) has content {describe(message.get('content'))}; fix: make it a string"
    return None


_PROMPT_FORMS = "a string or a list of {role, content} messages"


def describe(value: Any) -> str:
    """A short name of a value for a message: ``an int (7)``, ``a dict``, ``bytes``."""
    if value is None:
        return "null"
    if isinstance(value, bool | int | float):
        return f"{'an' if type(value).__name__[0] in 'aeiou' else 'a'} {type(value).__name__} ({value!r:.20})"
    if isinstance(value, bytes | bytearray):
        return "bytes"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    if isinstance(value, dict):
        return "an object (a dict)"
    return f"a {type(value).__name__}"


# -- rows as read from the file ---------------------------------------------------------------


@dataclass
class Findings:
    """The first bad row and how many there are, and the columns seen (in order)."""

    rules: RowRules
    unit: str  # how a row is placed: "line" (from 1) or "row index" (from 0)
    first: str | None = None
    bad: int = 0
    columns: list[str] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)

    def add(self, at: int, row: Mapping[str, Any]) -> None:
        if not row.keys() <= self._seen:
            self.columns += [k for k in row if k not in self._seen]
            self._seen.update(row)
        found = self.rules.problem(row)
        if found is not None:
            self.bad += 1
            self.first = self.first or f"{self.unit} {at}: {found}"

    def raise_any(self, rows: int) -> None:
        if rows == 0:
            return
        missing = self.rules.missing_columns(self.columns)
        if missing is not None:
            raise missing
        if self.first is not None:
            more = f" (and {self.bad - 1} more bad row{'s' if self.bad != 2 else ''})" if self.bad > 1 else ""
            raise DatasetError(f"{self.rules.where}: {self.first}{more}")


def scan_file(path: Path, builder: str, rules: RowRules) -> int | None:
    """Before ``datasets`` reads the file: not empty; text formats UTF-8; JSON files as
    ``datasets`` reads them (one object per line, or one list of objects), each row checked.
    Returns the first blank line of a JSON-lines file (None: none), for :func:`blank_line_hint`."""
    if path.stat().st_size == 0:
        raise DatasetError(
            f"{rules.where}: the file is empty (0 bytes); fix: point {rules.key}.path at a file with rows"
        )
    if builder == "parquet":
        return None
    if not _has_text(path):
        raise DatasetError(f"{rules.where}: the file holds only blank lines; fix: write one row per line")
    if builder == "json" and _first_byte(path) == b"[":
        _scan_json_list(path, rules)
    elif builder == "json":
        return _scan_json_lines(path, rules)
    else:
        for _ in _utf8_lines(path, rules):
            pass
    return None


def blank_line_hint(blank: int | None) -> str:
    """What to add to ``datasets``' own error about a JSON-lines file with a blank line: it skips
    them, except where a column's type changes between rows (it re-encodes those lines, and a
    blank one fails as ``Expected object or value``)."""
    if blank is None:
        return ""
    return (
        f"; line {blank} is blank, which datasets cannot read when a column's type changes between rows: "
        "fix: remove the blank lines"
    )


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            yield number, line[len(_BOM) :] if number == 1 and line.startswith(_BOM) else line


def _has_text(path: Path) -> bool:
    return any(line.strip() for _, line in _lines(path))


def _first_byte(path: Path) -> bytes:
    for _, line in _lines(path):
        if line.strip():
            return line.lstrip()[:1]
    return b""


def _utf8_lines(path: Path, rules: RowRules) -> Iterator[tuple[int, bytes]]:
    """The lines of ``path`` (bytes, a BOM dropped) once each is known to be UTF-8."""
    for number, line in _lines(path):
        if not line.isascii():  # ASCII is UTF-8: only the others need decoding
            _decode(line, number, rules)
        yield number, line


def _decode(line: bytes, number: int, rules: RowRules) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(
            f"{rules.where}: line {number} is not UTF-8 text (byte 0x{line[err.start]:02x} at column "
            f"{err.start + 1}); fix: save the file as UTF-8"
        ) from None


def _scan_json_lines(path: Path, rules: RowRules) -> int | None:
    findings, rows, blank = Findings(rules, "line"), 0, None
    for number, line in _lines(path):
        if line.isspace():
            blank = blank or number  # datasets skips blank lines, mostly (blank_line_hint)
            continue
        if too_deep(line, MAX_DEPTH):
            raise DatasetError(f"{rules.where}: line {number} nests deeper than {MAX_DEPTH} levels; {_FLATTEN}")
        text = _decode(line, number, rules)
        try:
            row = json.loads(text)
        except (ValueError, RecursionError) as err:
            detail = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
            column = f" at column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
            raise DatasetError(
                f"{rules.where}: line {number} is not JSON ({detail}{column}); fix: write one JSON object per line"
            ) from None
        if type(row) is not dict:
            raise DatasetError(
                f"{rules.where}: line {number} is {describe(row)}, not a JSON object; fix: write one object per "
                f'line, e.g. {{"{rules.prompt_field}": "...", "{rules.answer_field}": "..."}}'
            )
        rows += 1
        findings.add(number, row)
    findings.raise_any(rows)
    return blank


def _scan_json_list(path: Path, rules: RowRules) -> None:
    data = path.read_bytes().removeprefix(_BOM)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DatasetError(
            f"{rules.where}: line {line} is not UTF-8 text (byte 0x{data[err.start]:02x}); fix: save the file as UTF-8"
        ) from None
    if too_deep(data, MAX_DEPTH + 1):  # the list itself is one level
        raise DatasetError(f"{rules.where}: a row nests deeper than {MAX_DEPTH} levels; {_FLATTEN}")
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise DatasetError(
            f"{rules.where}: line {err.lineno} column {err.colno} is not JSON ({err.msg}); fix: the file must be "
            "one JSON list of objects, or one object per line"
        ) from None
    if not isinstance(rows, list):
        raise DatasetError(f"{rules.where}: the file is {describe(rows)}; fix: a list of objects, or one per line")
    findings = Findings(rules, "row index")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(
                f"{rules.where}: row index {i} of the list is {describe(row)}, not an object; fix: make every "
                "item an object"
            )
        findings.add(i, row)
    findings.raise_any(len(rows))


_FLATTEN = "fix: a row is an object of plain values (a prompt is a string or a list of {role, content} messages)"


def too_deep(data: bytes, bound: int) -> bool:
    """Whether the brackets of ``data`` (JSON) nest deeper than ``bound``, outside strings. Each
    pass drops the innermost pairs, so the depth is the passes it takes to empty: at most
    ``bound`` passes, all in C (no recursion, no parser that a deep row could crash)."""
    if data.count(b"[") + data.count(b"{") <= bound:
        return False
    brackets = _JSON_STRING.sub(b"", data).translate(_ONE_BRACKET, _NOT_BRACKETS)
    for passes in range(bound):
        shorter = brackets.replace(b"[]", b"")
        if shorter == brackets:  # unbalanced (invalid JSON): its unclosed brackets count as open levels
            return passes + brackets.count(b"[") > bound
        if not shorter:
            return False
        brackets = shorter
    return True


# -- rows once loaded -------------------------------------------------------------------------


def check_loaded(rows: Any, rules: RowRules) -> None:
    """Every loaded row (a ``datasets.Dataset``), by row index: its columns as Arrow batches,
    only the checked ones converted to Python."""
    findings = Findings(rules, "row index")
    names = [f for f in rules.fields() if f in rows.column_names]
    index = 0
    for batch in rows.select_columns(names).with_format("arrow").iter(batch_size=BATCH_ROWS):
        values = {name: batch.column(name).to_pylist() for name in names}
        for offset in range(batch.num_rows):
            findings.add(index + offset, {name: values[name][offset] for name in names})
        index += batch.num_rows
    findings.columns = list(rows.column_names)
    findings.raise_any(index)
