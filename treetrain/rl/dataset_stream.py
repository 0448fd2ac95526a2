"""Reading a dataset file in bounded pieces, for the checks of :mod:`treetrain.rl.dataset_check`:
lines of at most a given length (a longer one is skipped unread, not held), and the items of
one JSON list one at a time (``json.load`` of a list holds every row as Python objects, 25
times the file). Nothing here holds more than one row and a chunk of the file.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

BOM = b"\xef\xbb\xbf"
CHUNK = 256 << 10  # bytes read at a time where a file is read in pieces


def bounded_lines(path: Path, limit: int) -> Iterator[tuple[int, bytes, bool]]:
    """``(number from 1, line, whole)`` for each line of ``path`` (the newline kept, a leading
    BOM dropped). A line of more than ``limit`` bytes comes as its first ``limit + 1`` bytes with
    ``whole`` False, the rest skipped without being held."""
    with path.open("rb") as f:
        number = 0
        while line := f.readline(limit + 1):
            number += 1
            whole = len(line) <= limit or line.endswith(b"\n")
            if not whole:
                _skip_line(f)
            yield number, line.removeprefix(BOM) if number == 1 else line, whole


def _skip_line(f: IO[bytes]) -> None:
    while (rest := f.readline(CHUNK)) and not rest.endswith(b"\n"):
        pass


class ListError(ValueError):
    """Why a JSON list file cannot be read: ``kind`` "json" (the message says where), "deep"
    (item ``row`` nests past Python's parser) or "long" (item ``row`` passes the limit)."""

    def __init__(self, message: str, row: int | None = None, kind: str = "json") -> None:
        super().__init__(message)
        self.row, self.kind = row, kind


@dataclass
class _Text:
    """The decoded part of a file not yet consumed, read a chunk at a time."""

    file: IO[bytes]
    decoder: codecs.IncrementalDecoder
    buf: str = ""
    pos: int = 0
    line: int = 1  # the line of buf[pos]
    column0: int = 0  # the column (from 0) of buf[0]
    chunk: int = CHUNK
    read: int = 0  # bytes of the file read so far
    eof: bool = False

    def more(self, size: int = 0) -> bool:
        """Append ``size`` bytes, at least a chunk (False at the end of the file); what is
        consumed is dropped first."""
        if self.eof:
            return False
        if self.pos:
            newline = self.buf.rfind("\n", 0, self.pos)
            self.column0 = self.pos - newline - 1 if newline >= 0 else self.column0 + self.pos
            self.buf, self.pos = self.buf[self.pos :], 0
        raw = self.file.read(max(size, self.chunk))
        chunk = raw.removeprefix(BOM) if self.read == 0 else raw
        pending = self.decoder.getstate()[0]
        try:
            self.buf += self.decoder.decode(chunk, final=not raw)
        except UnicodeDecodeError as err:
            at = max(0, err.start - len(pending))
            line = self.line + self.buf.count("\n", self.pos) + chunk.count(b"\n", 0, at)
            byte = (pending + chunk)[err.start]
            raise ListError(f"line {line} is not UTF-8 text (byte 0x{byte:02x}); fix: save the file as UTF-8") from None
        self.read += len(raw)
        self.eof = not raw
        return True

    def skip_space(self) -> str:
        """Skip whitespace; the next character ('' at the end of the file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                if self.buf[self.pos] == "\n":
                    self.line += 1
                self.pos += 1
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos : self.pos + 1]

    def advance(self, end: int) -> None:
        self.line += self.buf.count("\n", self.pos, end)
        self.pos = end


_DECODER = json.JSONDecoder()


def json_list_items(path: Path, limit: int, chunk: int = CHUNK) -> Iterator[tuple[int, str, object]]:
    """``(index, text, value)`` of each item of the JSON list in ``path``, in order; ``text`` is
    the item as the file writes it (the caller judges its length). An item that does not parse
    raises :class:`ListError`: "long" when ``limit`` characters of it were read without its end
    in sight (it is never held whole), "json" when it ends but is not JSON. The file is read
    ``chunk`` bytes at a time, more while an item is unfinished."""
    with path.open("rb") as f:
        text = _Text(f, codecs.getincrementaldecoder("utf-8")(), chunk=chunk)
        if text.skip_space() != "[":
            raise ListError("the file does not start with [; fix: one JSON list of objects, or one object per line")
        text.advance(text.pos + 1)
        index = 0
        while True:
            nxt = text.skip_space()
            if nxt == "]" and index == 0:
                text.advance(text.pos + 1)
                break
            value, start, end = _item(text, index, limit)
            yield index, text.buf[start:end], value
            text.advance(end)
            index += 1
            nxt = text.skip_space()
            if nxt == "]":
                text.advance(text.pos + 1)
                break
            if nxt != ",":
                raise _not_json(text, "Expecting ',' delimiter" if nxt else "the list is not closed", None)
            text.advance(text.pos + 1)
        if text.skip_space():
            raise _not_json(text, "Extra data after the list", None)


def _item(text: _Text, index: int, limit: int) -> tuple[object, int, int]:
    """The item at ``text.pos`` and where it starts and ends in ``text.buf`` (reading more moves
    it to the front), read on until it parses, the file ends, or it passes ``limit``."""
    while True:
        try:
            value, end = _DECODER.raw_decode(text.buf, text.pos)
            return value, text.pos, end
        except RecursionError:
            raise ListError("", index, "deep") from None
        except json.JSONDecodeError as err:
            if len(text.buf) - text.pos > limit:
                if _ends_within(text.buf, text.pos, text.pos + limit):
                    raise _not_json(text, err.msg, index, err.pos) from None
                raise ListError("", index, "long") from None
            if not text.more(len(text.buf) - text.pos):  # doubling: an item is parsed O(log n) times
                raise _not_json(text, err.msg, index, err.pos) from None


def _not_json(text: _Text, msg: str, row: int | None, at: int | None = None) -> ListError:
    at = text.pos if at is None else at
    line = text.line + text.buf.count("\n", text.pos, at)
    newline = text.buf.rfind("\n", 0, at)
    column = at - newline if newline >= 0 else text.column0 + at + 1
    where = f"line {line} column {column}" + (f" (row index {row})" if row is not None else "")
    return ListError(f"{where} is not JSON ({msg}); fix: one JSON list of objects, or one object per line", row)


_TOKEN = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"?|[\[\]{},\s]')


def _ends_within(buf: str, start: int, stop: int) -> bool:
    """Whether the JSON value at ``buf[start]`` closes before ``stop`` (strings skipped, brackets
    counted): then a parse error in it is a real one, not the end of the read."""
    depth = 0
    for token in _TOKEN.finditer(buf, start, stop):
        c = token.group()[0]
        if c in "[{":
            depth += 1
        elif c in "]}" or (depth == 0 and (c == "," or c.isspace())):
            depth -= 1
            if depth <= 0:
                return True
    return False
