"""Rewards of dataset rows: a reply's text scored against its row (``trainer.reward``).

Built-in: ``builtin:math`` (math-verify: the reply's final answer equals the row's, as
mathematics), ``builtin:exact`` (the same text) and ``builtin:regex`` (``rewardArgs.pattern``
matches; a named group ``answer`` must equal the row's answer). A GSM8K answer ends with
``#### 42``: only the text after the last ``####`` is the answer, in the row and in the reply.
User rewards plug in as ``package.module:function``, called ``fn(completion, row, **rewardArgs)``.

Reward code is untrusted and may be slow: :class:`RewardRunner` calls it off the calling thread
with a timeout, scores a failure 0 (counted, logged once), and never raises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import math
import numbers
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treetrain.metrics import REWARD_FAILURE_REASONS as FAILURE_REASONS
from treetrain.rl.task import TaskError, _first_line, _import

GSM8K_MARK = "####"
MAX_STUCK = 4  # reward calls left running past their timeout at once; past it calls fail fast
MAX_DIGITS = 10_000  # math: numbers a reply may make sympy compute (9^(9^9) would hold the GIL for ever)


class RewardError(ValueError):
    """A reward that cannot be loaded; the message says what to change."""


RewardFn = Callable[[str, dict[str, Any]], float]


def final_answer(text: str) -> str:
    """The answer part of a GSM8K-style text: after the last ``####`` when there is one; stripped."""
    return text.rpartition(GSM8K_MARK)[2].strip()


@dataclass(frozen=True)
class AnswerReward:
    """A built-in reward: compares the reply with the row's answer, read from ``answer_field``
    (the runner sets it from trainer.dataset.answerField)."""

    name: str
    compare: Callable[[str, str | None], float]
    answer_field: str = "answer"

    def __call__(self, completion: str, row: dict[str, Any]) -> float:
        answer = row.get(self.answer_field)
        return self.compare(completion, None if answer is None else str(answer))


def _need(answer: str | None, name: str) -> str:
    if answer is None:
        raise RewardError(f"{name} needs the row's answer, and the row has none (trainer.dataset.answerField)")
    return answer


def exact_reward(completion: str, answer: str | None) -> float:
    return 1.0 if final_answer(completion) == final_answer(_need(answer, "builtin:exact")) else 0.0


def regex_reward(pattern: re.Pattern[str]) -> Callable[[str, str | None], float]:
    def score(completion: str, answer: str | None) -> float:
        found = pattern.search(completion)
        if found is None:
            return 0.0
        if "answer" not in pattern.groupindex:
            return 1.0
        got = found.group("answer")
        return 1.0 if got is not None and got.strip() == final_answer(_need(answer, "builtin:regex")) else 0.0

    return score


def math_reward(completion: str, answer: str | None) -> float:
    """1.0 when math-verify finds the reply's final answer equal to the row's. Its own signal
    timeouts work on the main thread only, so they are off; the runner's timeout bounds a call,
    and :func:`_too_big` refuses numbers whose computing would hold the GIL (no thread could time
    that out)."""
    from math_verify import parse, verify

    gold = _parse_gold(final_answer(_need(answer, "builtin:math")))
    if not gold:
        return exact_reward(completion, answer)
    pred = parse(final_answer(completion), parsing_timeout=None)
    if not pred or any(_too_big(p) for p in pred):
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


@functools.lru_cache(maxsize=4096)
def _parse_gold(text: str) -> list[Any]:
    from math_verify import parse

    _quiet_math_verify()
    return list(parse(text, parsing_timeout=None))


def _quiet_math_verify() -> None:
    """math-verify warns once that its timeouts are off: they are, on purpose (see math_reward)."""
    from math_verify import grader, parser

    grader.TIMEOUT_WARNING_SHOWN = True
    parser.TIMEOUT_WARNING_SHOWN = True


def _too_big(expr: Any) -> bool:
    """Whether evaluating ``expr`` could make a number of more than MAX_DIGITS digits."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return False
    return any((_digits(node) or 0.0) > MAX_DIGITS for node in sympy.preorder_traversal(expr))


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


def load_reward(spec: str, args: dict[str, Any]) -> RewardFn:
    """``builtin:math|exact|regex`` or ``package.module:function``; RewardError otherwise."""
    if spec == "builtin:math":
        _no_args(spec, args, ())
        return AnswerReward(spec, math_reward)
    if spec == "builtin:exact":
        _no_args(spec, args, ())
        return AnswerReward(spec, exact_reward)
    if spec == "builtin:regex":
        _no_args(spec, args, ("pattern",))
        pattern = args.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise RewardError("builtin:regex needs trainer.rewardArgs.pattern: a regular expression")
        try:
            compiled = re.compile(pattern)
        except re.error as err:
            raise RewardError(
                f"trainer.rewardArgs.pattern {pattern!r} is not a valid regular expression: {err}"
            ) from None
        return AnswerReward(spec, regex_reward(compiled))
    if spec.startswith("builtin:"):
        raise RewardError(f"unknown built-in reward {spec!r}; built-in: builtin:math, builtin:exact, builtin:regex")
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise RewardError(f"reward {spec!r} must be builtin:NAME or package.module:function")
    try:
        module = _import(module_name)
    except TaskError as err:
        raise RewardError(str(err).replace("task module", "reward module", 1)) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward module {module_name!r} has no callable {attr!r}; fix: trainer.reward")
    return ImportedReward(spec, fn, dict(args))


def reads_answer(spec: str | None, args: dict[str, Any]) -> bool:
    """Whether reward ``spec`` compares replies with the row's answer, so every row needs one:
    builtin:math and builtin:exact do, builtin:regex when its pattern has a group ``answer``. A
    user reward gets the whole row and reads what it wants: its rows are not checked."""
    if spec in ("builtin:math", "builtin:exact"):
        return True
    if spec == "builtin:regex":
        try:
            return "answer" in re.compile(str(args.get("pattern", ""))).groupindex
        except re.error:
            return False  # load_reward refuses the pattern
    return False


def _no_args(spec: str, args: dict[str, Any], takes: tuple[str, ...]) -> None:
    extra = sorted(set(args) - set(takes))
    if extra:
        valid = f"valid: {', '.join(takes)}" if takes else "it takes none"
        raise RewardError(f"{spec} takes no rewardArgs {', '.join(extra)}; {valid}")


@dataclass(frozen=True)
class ImportedReward:
    """A user reward: ``fn(completion, row, **args)``; an async one is run to its end on the
    runner's thread (which has no event loop of its own)."""

    spec: str
    fn: Callable[..., Any]
    args: dict[str, Any]

    def __call__(self, completion: str, row: dict[str, Any]) -> Any:
        out = self.fn(completion, row, **self.args)
        if inspect.iscoroutine(out):
            return asyncio.run(out)
        return out


class RewardRunner:
    """Scores replies with a reward function off the calling thread, each call bounded by
    ``timeout_s``. An error, a timeout, or a result that is not a finite number scores 0.0,
    counts in ``failures`` and logs one line naming where (step, group, row). A hung call is
    abandoned (its daemon thread runs on); at most MAX_STUCK run at once, so a reward that
    always hangs costs threads up to that cap, and calls past it fail as timeouts at once
    rather than pile up."""

    def __init__(
        self,
        fn: RewardFn,
        *,
        timeout_s: float,
        answer_field: str,
        log: Callable[[str], None],
        max_stuck: int = MAX_STUCK,
    ) -> None:
        self.fn: RewardFn = dataclasses.replace(fn, answer_field=answer_field) if isinstance(fn, AnswerReward) else fn
        self.timeout_s = timeout_s
        self.log = log
        self.failures: dict[str, int] = dict.fromkeys(FAILURE_REASONS, 0)
        self._slots = threading.BoundedSemaphore(max_stuck)
        self._lock = threading.Lock()

    def score(self, completion: str, row: dict[str, Any], where: str) -> float:
        if not self._slots.acquire(timeout=self.timeout_s):
            return self._fail("timeout", where, f"{MAX_STUCK} earlier reward calls are still running past the timeout")
        out: list[Any] = []
        done = threading.Event()

        def work() -> None:
            try:
                out.append(("value", self.fn(completion, row)))
            except BaseException as err:  # the reward's own code: any failure scores 0
                out.append(("error", err))
            finally:
                self._slots.release()
                done.set()

        threading.Thread(target=work, name="treetrain-reward", daemon=True).start()
        if not done.wait(self.timeout_s):
            return self._fail("timeout", where, f"took longer than trainer.rewardTimeoutSeconds ({self.timeout_s:g}s)")
        kind, value = out[0]
        if kind == "error":
            return self._fail("error", where, f"{type(value).__name__}: {_first_line(value)}")
        if isinstance(value, numbers.Real) and math.isfinite(value):
            return float(value)
        return self._fail("error", where, f"returned {type(value).__name__} {value!r:.60}, not a finite number")

    def _fail(self, reason: str, where: str, detail: str) -> float:
        with self._lock:
            self.failures[reason] += 1
        self.log(f"reward {reason} at {where}: {detail}; scored 0.0")
        return 0.0
