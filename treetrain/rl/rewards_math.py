"""``builtin:math``: math-verify's verdict on a reply's final answer against the row's, within bounds.

A short text can make sympy compute for hours (``9^{9^{9}}`` is 369 million digits, made in one C
call); the pool's timeout stops such a call (treetrain.rl.rewards_pool), and these bounds make the
common cases fail at once instead of at the timeout:

- ``MAX_MATH_CHARS``: math-verify reads the last characters of a reply only (its answer ends it);
- ``MAX_NESTING``: brackets nested deeper than this are not parsed (each level costs the parser
  more: 200 nested ``\\frac`` took 1.8 s, 1,000 took 12 s);
- ``MAX_DIGITS``: a parsed expression whose value would have more digits is not evaluated;
- ``MAX_TERMS``: a sum or product over more terms is not evaluated.

A reply past a bound scores 0 (it is not an answer); a row's answer past one raises
:class:`MathAnswerError` naming the bound (the runner counts it as an error, naming the row).

math-verify reads a bare number even where it only starts an expression: ``2^{64}`` outside
``$...$`` reads as ``2``, ``3\\sqrt{2}`` as ``3``, ``10!`` as ``10``. A number read that way is
not taken: the bare expression around it is read as LaTeX instead, and when that fails there is
no answer (a partial match never scores).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

MAX_MATH_CHARS = 2_000
MAX_NESTING = 24
MAX_DIGITS = 10_000
MAX_TERMS = 10_000

# What may follow a number that only starts an expression (math-verify takes the number alone).
_GOES_ON = re.compile(r"(?:[\^_!]|\s*\\(?:times|cdot|div|pm|mp|sqrt|frac|dfrac|tfrac|pi|binom)(?![a-zA-Z]))")
# ... or that ends one (``2 \cdot 3`` read as ``3``).
_CAME_FROM = re.compile(r"\\(?:times|cdot|div|pm|mp)\s*$")
# A bare (no $...$) run of LaTeX mathematics: digits, operators, brackets, commands, spaces.
_BARE_RUN = re.compile(r"(?:[0-9.+\-*/()\[\]{}!^_=|]|\\[a-zA-Z]+|\\[,;! ]|[ \t])+")
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class MathAnswerError(ValueError):
    """A row's answer builtin:math cannot compare with (too long, too deep, too large)."""


def math_verdict(reply: str, gold: str) -> bool | None:
    """Whether ``reply``'s answer equals ``gold`` as mathematics; None when math-verify reads no
    mathematics in ``gold`` (the caller compares the texts instead)."""
    from math_verify import verify

    expected = gold_expressions(gold)
    if not expected:
        return None
    found = reply_expressions(reply)
    if not found:
        return False
    return bool(verify(list(expected), found, timeout_seconds=None))


@functools.lru_cache(maxsize=4096)
def gold_expressions(text: str) -> tuple[Any, ...]:
    """What math-verify reads in a row's answer; MathAnswerError past a bound."""
    if len(text) > MAX_MATH_CHARS:
        raise MathAnswerError(
            f"the row's answer is {len(text)} characters; builtin:math compares answers of up to "
            f"{MAX_MATH_CHARS}; fix: shorten the row's answer, or use builtin:exact"
        )
    depth = nesting(text)
    if depth > MAX_NESTING:
        raise MathAnswerError(
            f"the row's answer nests brackets {depth} deep; builtin:math reads up to {MAX_NESTING}; "
            "fix: simplify the row's answer, or use builtin:exact"
        )
    found = _read(text)
    if any(too_big(e) for e in found):
        raise MathAnswerError(
            f"the row's answer {text[:40]!r} is too large to compare (more than {MAX_DIGITS} digits, "
            f"or a sum or product of more than {MAX_TERMS} terms); fix: give the row a smaller answer"
        )
    return tuple(found)


def reply_expressions(text: str) -> list[Any]:
    """What math-verify reads at the end of a reply; nothing past a bound."""
    tail = text[-MAX_MATH_CHARS:]
    if nesting(tail) > MAX_NESTING:
        return []
    found = _read(tail)
    return [] if any(too_big(e) for e in found) else found


def nesting(text: str) -> int:
    """The deepest nesting of (), [] and {} in ``text`` (unbalanced closers are ignored)."""
    depth = deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}" and depth:
            depth -= 1
    return deepest


def _read(text: str) -> list[Any]:
    from math_verify import LatexExtractionConfig, parse

    _quiet_math_verify()
    found = list(parse(text, parsing_timeout=None))
    start = _partial_number(text, found)
    if start is None:
        return found
    run = next((m for m in _BARE_RUN.finditer(text) if m.start() <= start < m.end()), None)
    bare = run.group().strip().strip("=").strip().rstrip(".,;:").strip() if run else ""
    if not bare:
        return []
    reread = list(parse(f"${bare}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=None))
    return reread if reread and not isinstance(reread[0], str) else []


def _partial_number(text: str, found: list[Any]) -> int | None:
    """Where the number math-verify read starts in ``text`` when, there, it goes on as an
    expression (``2^{64}`` read as ``2``, ``2 \\cdot 3`` as ``3``); None when it does not (or was not a number). The
    number's last occurrence that goes on counts, math-verify reading from the end."""
    if len(found) < 2 or not isinstance(found[1], str) or not _PLAIN_NUMBER.fullmatch(found[1]):
        return None
    number = re.compile(r"(?<![\w.\\^_{])" + re.escape(found[1]) + r"(?![\d])")
    starts = [
        m.start()
        for m in number.finditer(text)
        if _GOES_ON.match(text, m.end()) or _CAME_FROM.search(text, max(0, m.start() - 12), m.start())
    ]
    return starts[-1] if starts else None


def _quiet_math_verify() -> None:
    """math-verify warns once that its own timeouts are off: they are, on purpose (they use
    SIGALRM, main thread only); the pool's timeout bounds a call."""
    from math_verify import grader, parser

    grader.TIMEOUT_WARNING_SHOWN = True
    parser.TIMEOUT_WARNING_SHOWN = True


def too_big(expr: Any) -> bool:
    """Whether evaluating ``expr`` could make a number of more than MAX_DIGITS digits, or sum or
    multiply more than MAX_TERMS terms."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return False
    for node in sympy.preorder_traversal(expr):
        if (_digits(node) or 0.0) > MAX_DIGITS:
            return True
        if isinstance(node, sympy.Sum | sympy.Product) and _terms(node) > MAX_TERMS:
            return True
    return False


def _terms(node: Any) -> float:
    """The terms of a sum or product whose limits are numbers (0 with others: a symbolic one is
    not evaluated term by term)."""
    terms = 1.0
    for _, low, high in node.limits:
        ends = [_digits(low), _digits(high)]
        if any(d is None for d in ends):
            return 0.0
        if max(d for d in ends if d is not None) > 18:
            return math.inf
        try:
            terms *= max(int(high) - int(low) + 1, 0)
        except (TypeError, ValueError):  # not a real number: not evaluated term by term
            return 0.0
    return terms


def _digits(node: Any) -> float | None:
    """An upper bound of the digits of a numeric sympy tree's value (numerator or denominator,
    which cost the same to compute); None where it is not a plain number tree."""
    import sympy

    if isinstance(node, sympy.Rational):  # Integer too
        return max(abs(int(node.p)).bit_length(), int(node.q).bit_length()) * 0.30103 + 1
    if isinstance(node, sympy.Float | sympy.NumberSymbol):
        return 400.0  # a float's exponent is bounded
    parts = [_digits(a) for a in node.args]
    if not parts or any(p is None for p in parts):
        return None
    known = [p for p in parts if p is not None]
    if isinstance(node, sympy.Add):
        return max(known) + 1
    if isinstance(node, sympy.Mul):
        return sum(known)
    if isinstance(node, sympy.Pow):
        base, exp = known
        if exp > 7:
            return math.inf
        power = abs(int(node.exp.p)) if isinstance(node.exp, sympy.Rational) else 10.0**exp
        return base * power
    if isinstance(node, sympy.factorial | sympy.factorial2 | sympy.subfactorial | sympy.gamma | sympy.binomial):
        n = max(known)
        return math.inf if n > 7 else 10.0**n * n
    return max(known)
