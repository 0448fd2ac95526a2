"""Rewards of dataset rows: a reply's text scored against its row (``trainer.reward``).

Built-in: ``builtin:math`` (math-verify: the reply's final answer equals the row's, as
mathematics), ``builtin:exact`` (the same text) and ``builtin:regex`` (``rewardArgs.pattern``
matches; a named group ``answer`` must equal the row's answer). A GSM8K answer ends with
``#### 42``: only the text after the last ``####`` is the answer, in the row and in the reply.
User rewards plug in as ``package.module:function``, called ``fn(completion, row, **rewardArgs)``.

Reward code is untrusted and may be slow: :class:`RewardRunner` runs it in a worker process
(treetrain.rl.rewards_pool) whose call a timeout can stop, scores a failure 0 (counted, logged
once), and raises only when SIGTERM stops the call (``TaskInterrupted``: the step is abandoned).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from treetrain.metrics import REWARD_FAILURE_REASONS as FAILURE_REASONS
from treetrain.rl.rewards_math import MathAnswerError, math_verdict
from treetrain.rl.rewards_pool import PoolError, RewardPool, RewardTimeout
from treetrain.rl.rewards_worker import Recipe
from treetrain.rl.user_code import import_spec

GSM8K_MARK = "####"


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
    args: dict[str, Any] = field(default_factory=dict)  # rewardArgs: a worker makes the reward again from them

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
    """1.0 when math-verify finds the reply's final answer equal to the row's, within the bounds
    of treetrain.rl.rewards_math (a row's answer past them is a RewardError naming the bound);
    a row's answer that holds no mathematics is compared as text."""
    gold = final_answer(_need(answer, "builtin:math"))
    try:
        verdict = math_verdict(final_answer(completion), gold)
    except MathAnswerError as err:
        raise RewardError(f"builtin:math: {err}") from None
    if verdict is None:
        return exact_reward(completion, answer)
    return 1.0 if verdict else 0.0


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
        return AnswerReward(spec, regex_reward(compiled), args=dict(args))
    if spec.startswith("builtin:"):
        raise RewardError(f"unknown built-in reward {spec!r}; built-in: builtin:math, builtin:exact, builtin:regex")
    malformed = f"reward {spec!r} must be builtin:NAME or package.module:function"
    module_name, attr, fn = import_spec(spec, "reward", RewardError, malformed)
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
    """A user reward: ``fn(completion, row, **args)``; an async one is run to its end (in the
    worker process, which has no event loop of its own)."""

    spec: str
    fn: Callable[..., Any]
    args: dict[str, Any]

    def __call__(self, completion: str, row: dict[str, Any]) -> Any:
        out = self.fn(completion, row, **self.args)
        if inspect.iscoroutine(out):
            return asyncio.run(out)
        return out


class RewardRunner:
    """Scores replies with a reward made by :func:`load_reward`, each call in a worker process
    of ``pool`` (its own when None) and bounded by ``timeout_s``. An error, a timeout, or a
    result that is not a finite number scores 0.0, counts in ``failures`` and logs one line
    naming where (step, group, row). A call past its timeout has its worker killed: a reward
    stuck in C (holding its interpreter's lock) costs one timeout, and the next call gets a
    fresh worker. After :meth:`stop` (SIGTERM) calls end within the grace, raising
    ``TaskInterrupted``."""

    def __init__(
        self,
        fn: RewardFn,
        *,
        timeout_s: float,
        answer_field: str,
        log: Callable[[str], None],
        pool: RewardPool | None = None,
    ) -> None:
        self.recipe = recipe_of(fn, answer_field)
        self.timeout_s = timeout_s
        self.log = log
        self.failures: dict[str, int] = dict.fromkeys(FAILURE_REASONS, 0)
        self.pool = pool if pool is not None else RewardPool()
        self._owns_pool = pool is None
        self._lock = threading.Lock()

    def score(self, completion: str, row: dict[str, Any], where: str) -> float:
        try:
            kind, value = self.pool.call(self.recipe, completion, row, self.timeout_s)
        except RewardTimeout as err:
            return self._fail("timeout", where, str(err))
        except PoolError as err:
            return self._fail("error", where, str(err))
        if kind == "error":
            return self._fail("error", where, str(value))
        return float(value)

    def stop(self) -> None:
        """SIGTERM (from its handler): calls end within the grace."""
        self.pool.stop()

    def close(self) -> None:
        """End the worker processes (of the runner's own pool; a shared one is its owner's)."""
        if self._owns_pool:
            self.pool.close()

    def _fail(self, reason: str, where: str, detail: str) -> float:
        with self._lock:
            self.failures[reason] += 1
        self.log(f"reward {reason} at {where}: {detail}; scored 0.0")
        return 0.0


def recipe_of(fn: RewardFn, answer_field: str) -> Recipe:
    """What a worker process needs to make ``fn`` again: its spec, rewardArgs, the answer column,
    and this process's import path."""
    if isinstance(fn, AnswerReward):
        return Recipe(fn.name, dict(fn.args), answer_field, tuple(sys.path))
    if isinstance(fn, ImportedReward):
        return Recipe(fn.spec, dict(fn.args), answer_field, tuple(sys.path))
    raise TypeError(f"RewardRunner runs rewards made by load_reward, not {type(fn).__name__}")
