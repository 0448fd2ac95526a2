"""Checks of a dataset's rows before the model loads, each failure one line naming the file, the
line (JSON lines, from 1) or row index (from 0) and the fix.

Text files are scanned before Hugging Face ``datasets`` sees them: an empty file, a line that is
not UTF-8 or not JSON, and a row nested past :data:`MAX_DEPTH` (pyarrow's JSON reader crashes the
process on a row nested 100,000 deep) are refused with the line number, which ``datasets`` would
only log. The rows of JSON files are checked as read (``datasets`` may re-encode a column whose
type changes between rows, hiding a bad value); Parquet, CSV and save_to_disk rows once loaded.

Rows are sized by bytes before any tokenizer sees them (:class:`ByteLimits`): a prompt that
cannot fit ``trainer.maxEpisodeTokens``, or a row too large to hold, is a bad row. The scan
streams: it holds one row (at most ``ByteLimits.row`` bytes) and a chunk of the file, never
the file, and never reads an over-long line whole.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treetrain.config.trainer_settings import TrainerSettings
from treetrain.rl.dataset_stream import ListError, bounded_lines, json_list_items
from treetrain.rl.task import TaskError

ROLES = ("system", "user", "assistant")
MAX_DEPTH = 64  # nesting of a row's JSON; a list of {role, content} messages is 3 deep
# A token of text is 3 to 5 bytes in the common tokenizers: a prompt of more than 8 bytes a token
# of trainer.maxEpisodeTokens is refused before any tokenizer spends time on it (no reply would fit).
BYTES_PER_TOKEN = 8
ROW_BYTES_MIN = 16 << 20  # a row may hold this much beside its prompt (rewards and agents read it)
# A JSON string; an unterminated one runs to the end, so every match succeeds and the scan is
# linear (with the closing quote required, each later quote of a hostile line rescans the rest).
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_ONE_BRACKET = bytes.maketrans(b"{}", b"[]")


class DatasetError(TaskError):
    """A dataset that cannot be read or used; the message says what to change. A TaskError, so
    one raised at any step stops ``treetrain train`` with exit 2 and its one line."""


@dataclass(frozen=True)
class ByteLimits:
    """How large a row may be, in bytes, judged before tokenizing: its prompt at most ``prompt``
    (``tokens`` x :data:`BYTES_PER_TOKEN`), the whole row (a JSON line, a CSV line, a JSON list
    item, the checked columns of a loaded row) at most ``row``."""

    tokens: int  # trainer.maxEpisodeTokens, named in the messages
    prompt: int
    row: int

    @classmethod
    def for_episode(cls, max_episode_tokens: int) -> ByteLimits:
        prompt = max_episode_tokens * BYTES_PER_TOKEN
        return cls(max_episode_tokens, prompt, max(ROW_BYTES_MIN, 4 * prompt))

    def prompt_message(self, field_name: str, size: int) -> str:
        return (
            f"prompt {field_name!r} has {size:,} bytes, more than trainer.maxEpisodeTokens ({self.tokens}) x "
            f"{BYTES_PER_TOKEN} = {self.prompt:,}; fix: shorten or drop the row, or raise trainer.maxEpisodeTokens"
        )

    def row_message(self) -> str:
        return (
            f"the row is longer than {self.row:,} bytes, the most one row may hold (the larger of "
            f"{ROW_BYTES_MIN >> 20} MiB and 4 x the prompt's {self.prompt:,}); fix: shorten or drop the row"
        )


DEFAULT_LIMITS = ByteLimits.for_episode(TrainerSettings.model_fields["max_episode_tokens"].default)


@dataclass(frozen=True)
class RowRules:
    """What a row must hold: ``prompt_field`` always; ``answer_field`` when ``answer_for`` (the
    reward that compares replies with the answer) is set."""

    key: str  # the config key of the dataset: trainer.dataset or trainer.eval.dataset
    path: str  # as the config gives it
    prompt_field: str
    answer_field: str
    answer_for: str | None
    limits: ByteLimits = DEFAULT_LIMITS

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
        # A string of n characters is at most 4n bytes: the common prompt needs no counting.
        if type(prompt) is not str or len(prompt) * 4 > self.limits.prompt:
            size = prompt_bytes(prompt, self.limits.prompt) if prompt is not None else 0
            if size > self.limits.prompt:
                return self.limits.prompt_message(self.prompt_field, size)
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


def prompt_bytes(prompt: str | list[dict[str, Any]], limit: int) -> int:
    """The UTF-8 bytes of a checked prompt's text, exact where that is near ``limit`` (a
    character is 1 to 4 bytes: most prompts need no encoding to tell)."""
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    chars = sum(map(len, texts))
    if chars * 4 <= limit:
        return chars
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


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
            self.flag(at, found)

    def flag(self, at: int, found: str) -> None:
        self.bad += 1
        self.first = self.first or f"{self.unit} {at}: {found}"

    def raise_any(self, rows: int) -> None:
        if rows == 0:
            return
        missing = self.rules.missing_columns(self.columns) if self.columns else None  # none: no row was read
        if missing is not None:
            raise missing
        self.raise_first()

    def raise_first(self) -> None:
        if self.first is not None:
            more = f" (and {self.bad - 1} more bad row{'s' if self.bad != 2 else ''})" if self.bad > 1 else ""
            raise DatasetError(f"{self.rules.where}: {self.first}{more}")


def scan_file(path: Path, builder: str, rules: RowRules, list_out: Path | None = None) -> int | None:
    """Before ``datasets`` reads the file: not empty; text formats UTF-8; JSON files as
    ``datasets`` reads them (one object per line, or one list of objects), each row checked.
    A JSON list's rows are written to ``list_out`` as JSON lines (``datasets`` would load the
    whole list as Python objects); see :func:`json_list`. Returns the first blank line of a
    JSON-lines file (None: none), for :func:`blank_line_hint`."""
    if path.stat().st_size == 0:
        raise DatasetError(
            f"{rules.where}: the file is empty (0 bytes); fix: point {rules.key}.path at a file with rows"
        )
    if builder == "parquet":
        return None
    first = _first_text(path, rules.limits.row)
    if first is None:
        raise DatasetError(f"{rules.where}: the file holds only blank lines; fix: write one row per line")
    if builder == "json" and first == b"[":
        _scan_json_list(path, rules, list_out)
    elif builder == "json":
        return _scan_json_lines(path, rules)
    else:
        _scan_text_lines(path, rules)
    return None


def json_list(path: Path, limit: int) -> bool:
    """Whether ``path`` (a .json file) holds one JSON list rather than JSON lines."""
    return _first_text(path, limit) == b"["


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


def _first_text(path: Path, limit: int) -> bytes | None:
    """The first non-blank byte of the file (None: only blank lines)."""
    for _, line, whole in bounded_lines(path, limit):
        if line.strip() or not whole:
            return line.lstrip()[:1]
    return None


def _decode(line: bytes, number: int, rules: RowRules) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(
            f"{rules.where}: line {number} is not UTF-8 text (byte 0x{line[err.start]:02x} at column "
            f"{err.start + 1}); fix: save the file as UTF-8"
        ) from None


def _scan_text_lines(path: Path, rules: RowRules) -> None:
    """A CSV file: UTF-8, and no line longer than a row may be (a row is one line or more)."""
    findings = Findings(rules, "line")
    for number, line, whole in bounded_lines(path, rules.limits.row):
        if not whole:
            findings.flag(number, rules.limits.row_message())
        elif not line.isascii():  # ASCII is UTF-8: only the others need decoding
            _decode(line, number, rules)
    findings.raise_first()


def _scan_json_lines(path: Path, rules: RowRules) -> int | None:
    findings, rows, blank = Findings(rules, "line"), 0, None
    for number, line, whole in bounded_lines(path, rules.limits.row):
        if not whole:
            rows += 1
            findings.flag(number, rules.limits.row_message())
            continue
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


def _scan_json_list(path: Path, rules: RowRules, out: Path | None) -> None:
    """The items of a JSON list one at a time; each written to ``out`` as one JSON line (a raw
    newline or carriage return in JSON is whitespace: strings cannot hold one)."""
    findings, rows = Findings(rules, "row index"), 0
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(out.open("w", encoding="utf-8")) if out is not None else None
        try:
            for index, text, row in json_list_items(path, rules.limits.row):
                rows += 1
                if len(text) > rules.limits.row:
                    findings.flag(index, rules.limits.row_message())
                    continue
                if text.count("[") + text.count("{") > MAX_DEPTH and too_deep(text.encode(), MAX_DEPTH):
                    raise ListError("", index, "deep")
                if type(row) is not dict:
                    raise DatasetError(
                        f"{rules.where}: row index {index} of the list is {describe(row)}, not an object; fix: make "
                        "every item an object"
                    )
                findings.add(index, row)
                if sink is not None:
                    sink.write(text.replace("\n", " ").replace("\r", " ") + "\n")
        except ListError as err:
            if err.kind == "deep":
                raise DatasetError(
                    f"{rules.where}: row index {err.row} nests deeper than {MAX_DEPTH} levels; {_FLATTEN}"
                ) from None
            found = f"row index {err.row}: {rules.limits.row_message()}" if err.kind == "long" else str(err)
            raise DatasetError(f"{rules.where}: {found}") from None
    findings.raise_any(rows)


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
