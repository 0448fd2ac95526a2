"""What a backend string that does not follow the grammar means, and how to fix it: the one
line (problem, column, fix) the parser raises for a Lark syntax error."""

from __future__ import annotations

import re

from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from treetrain.alloc.errors import AllocationSyntaxError
from treetrain.alloc.registry import default_training, either, names

DIMS_RE = re.compile(r"(?:[a-z][0-9]+)+")


def server() -> str:
    """A rollout server's name for examples."""
    return names("inference")[0]


def syntax_error(spec: str, exc: UnexpectedInput) -> AllocationSyntaxError:
    at_end = isinstance(exc, UnexpectedToken) and exc.token.type == "$END"
    pos = len(spec) if at_end or exc.pos_in_stream is None else exc.pos_in_stream
    pos = min(max(pos, 0), len(spec))
    problem, fix = _explain(spec, pos, exc)
    return AllocationSyntaxError(problem, fix=fix).located(spec, pos + 1)


def _explain(spec: str, pos: int, exc: UnexpectedInput) -> tuple[str, str]:
    before, char = spec[:pos], spec[pos : pos + 1]
    head = before.strip()
    example = f"e.g. {default_training()}:d4t2 or {server()}:d2t4"
    backend = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)", spec)
    name = backend.group(1) if backend else ""
    after_colon = spec.split(":", 1)[1].lstrip() if ":" in spec else ""

    if char == ":" and not head:
        rest = spec[pos + 1 :].strip()
        trainers = either(f"{b}:{rest}" for b in names("training")[:2])
        return "backend missing before ':'", f"write {trainers} ({'/'.join(names('inference'))} for rollout)"
    if char == "." and head in names():
        rest = spec[pos + 1 :].strip()
        return "unexpected '.'", f"use ':' between backend and dims, e.g. {head}:{rest or 'd4'}"
    if spec.count("(") > spec.count(")") and not char:
        return "unbalanced parentheses: '(' is never closed", "add ')' at the end of the hybrid layout"
    if char == ")" and spec[:pos].count("(") == spec[:pos].count(")"):
        return "unbalanced parentheses: ')' without a matching '('", "wrap the hybrid layout as (attn:...|ffn:...)"
    if after_colon.startswith(("attn", "ffn")) and ":" in spec and not after_colon.startswith("("):
        return (
            "the hybrid MoE layout must be in parentheses",
            f"write {name}:({after_colon.rstrip(')')})",
        )
    if not char:
        if head.endswith(":"):
            return "no dimensions after ':'", f"add dimensions, e.g. {head}d4"
        if head in names():
            return f"{head} has no dimensions", f"write {head}:d4 (backend, ':', dims)"
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", head):
            return f"{head!r} is not a backend string", f"write backend:dims with a backend of {', '.join(names())}"
        if head.endswith(("+", "|")):
            return f"nothing after {head[-1]!r}", f"write one engine per backend field, {example}"
        return "the backend string ends too early", f"write backend:dims, {example}"
    if char.isspace():
        char = spec[pos:].lstrip()[:1]
    if head in names() and DIMS_RE.fullmatch(spec[pos:].strip()):
        return f"missing ':' after {head}", f"write {head}:{spec[pos:].strip()}"
    if char.isalpha() and char.isupper() and ":" in before:
        word = re.match(r"\s*([A-Za-z][0-9]*)", spec[pos:])
        written = word.group(1) if word else char
        return f"dimension letters are lower-case, got {written!r}", f"write {written.lower()}"
    if char.isdigit() and ":" in before:
        return f"a size without a dimension letter at {char!r}", "write a letter before each size, e.g. d4t2"
    if isinstance(exc, UnexpectedCharacters) and not (char.isalnum() or char in ":+|()[]_"):
        return f"unexpected character {char!r}", f"backend strings use letters, digits and ':', {example}"
    return f"unexpected {char!r}", f"write backend:dims, {example}"
