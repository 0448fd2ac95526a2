"""A user's code in the run: ``package.module:function`` imported with one clear line for each
way it can fail, and a user task's episodes checked as they play (a broken task stops the run
with one line naming it, never a traceback)."""

from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass
from typing import Any


class TaskError(ValueError):
    """A task (or agent, reward) that cannot be loaded or built; the message says what to change."""


def import_spec(spec: str, kind: str, error: type[ValueError], malformed: str) -> tuple[str, str, Any]:
    """``package.module:function`` imported: (the module's name, the attribute's name, the
    attribute or None). ``malformed``: the message when ``spec`` is not of that form; a module
    that cannot be imported is one line naming it as the ``kind``'s (task, agent, reward)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise error(malformed)
    try:
        module = import_module(module_name)
    except TaskError as err:
        raise error(str(err).replace("task module", f"{kind} module", 1)) from None
    return module_name, attr, getattr(module, attr, None)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def import_module(module_name: str) -> Any:
    """A user's module (a task's; callers name theirs); any failure while importing it (missing, a syntax error, an exception
    at import time) is one line naming the module, where it failed, and the fix."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise TaskError(
                f"cannot import task module {module_name!r}: {err}; fix: install it, or put its directory on PYTHONPATH"
            ) from None
        problem = f"{type(err).__name__}: {err}"
    except SyntaxError as err:
        problem = f"{type(err).__name__} at {err.filename}:{err.lineno}: {err.msg}"
    except Exception as err:  # the module's own code raised while it was imported
        problem = f"{type(err).__name__}: {first_line(err)}{_where(err)}"
    raise TaskError(
        f"cannot import task module {module_name!r}: {problem}; fix: correct the module "
        f"(python -c 'import {module_name}' shows the traceback)"
    ) from None


def _where(err: BaseException) -> str:
    """`` (at FILE:LINE)`` of the innermost frame of a traceback, or ''."""
    tb = err.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f" (at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"


def check_declared(spec: str, task: Any, max_size: int) -> Any:
    """The fields a user task declares: a vocabulary size, a reply length (up to ``max_size``)
    and stop tokens."""
    vocab = getattr(task, "vocab_size", None)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise TaskError(f"task {spec!r}: vocab_size must be an integer >= 1, got {vocab!r}; fix: the task's code")
    new = getattr(task, "max_new_tokens", None)
    if isinstance(new, bool) or not isinstance(new, int) or not 1 <= new <= max_size:
        raise TaskError(
            f"task {spec!r}: max_new_tokens must be an integer in 1..{max_size}, got {new!r}; fix: the task's code"
        )
    stops = getattr(task, "stop_token_ids", ())
    if isinstance(stops, str | bytes) or not all(_is_token(t, vocab) for t in _iterable(stops)):
        raise TaskError(
            f"task {spec!r}: stop_token_ids must be token ids in 0..{vocab - 1}, got {stops!r}; fix: the task's code"
        )
    if not callable(getattr(task, "episode", None)):
        raise TaskError(f"task {spec!r}: episode must be a method (episode(seed) -> an episode); fix: the task's code")
    return task


def _iterable(value: Any) -> list[Any]:
    try:
        return list(value)
    except TypeError:
        return [value]  # not iterable: checked (and refused) as one token


def _is_token(t: Any, vocab: int) -> bool:
    return type(t) is int and 0 <= t < vocab


def check_tokens(spec: str, what: str, tokens: Any, vocab: int, *, empty_ok: bool) -> list[int]:
    """``tokens`` (what a task's episode returned) as a list of token ids, each in ``0..vocab-1``;
    else a :class:`TaskError` naming the task, the call and the first bad value."""
    fix = f"fix: return a list of token ids (ints in 0..{vocab - 1}) from {what}"
    if isinstance(tokens, str | bytes) or not hasattr(tokens, "__iter__"):
        raise TaskError(f"task {spec!r}: {what} returned {type(tokens).__name__} {_short(tokens)}; {fix}")
    ids = list(tokens)
    if not ids and not empty_ok:
        raise TaskError(f"task {spec!r}: {what} returned an empty prompt; {fix} (at least one)")
    if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < vocab)):
        return ids  # the common case, checked without a per-token branch
    for i, t in enumerate(ids):
        if type(t) is not int:
            raise TaskError(
                f"task {spec!r}: {what} returned {type(t).__name__} {_short(t)} at position {i}, not a token id; {fix}"
            )
        if not 0 <= t < vocab:
            raise TaskError(
                f"task {spec!r}: {what} returned token id {t} at position {i}, outside the task's vocab_size "
                f"{vocab}; fix: return ids below vocab_size (or declare the vocab_size the task uses)"
            )
    raise AssertionError("unreachable")


def check_reply(spec: str, out: Any, vocab: int) -> tuple[list[int] | None, float]:
    """What ``respond`` returned: ``(next user turn or None, reward)``, the reward a finite number."""
    what = "episode.respond()"
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise TaskError(
            f"task {spec!r}: {what} returned {type(out).__name__} {_short(out)}; fix: return a pair "
            "(next user turn as token ids, or None when the episode is over; reward as a float)"
        )
    nxt, reward = out
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise TaskError(
            f"task {spec!r}: {what} returned the reward {type(reward).__name__} {_short(reward)}; "
            "fix: return a finite float as the reward"
        )
    return (None if nxt is None else check_tokens(spec, what, nxt, vocab, empty_ok=True)), float(reward)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class CheckedEpisode:
    """A user task's episode whose every answer is checked (:func:`check_tokens`,
    :func:`check_reply`): a broken task stops the run with one line naming it."""

    spec: str
    inner: Any
    vocab: int

    def prompt(self) -> list[int]:
        return check_tokens(self.spec, "episode.prompt()", self.inner.prompt(), self.vocab, empty_ok=False)

    def respond(self, response: list[int]) -> tuple[list[int] | None, float]:
        return check_reply(self.spec, self.inner.respond(response), self.vocab)


class CheckedTask:
    """A user task (``package.module:function``) behind checks of what its episodes return;
    every other attribute is the task's own."""

    def __init__(self, spec: str, task: Any) -> None:
        self.spec = spec
        self.task = task
        self.vocab_size: int = task.vocab_size
        self.max_new_tokens: int = task.max_new_tokens
        self.stop_token_ids: tuple[int, ...] = tuple(getattr(task, "stop_token_ids", ()))

    def __getattr__(self, name: str) -> Any:
        if name == "task":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.task, name)

    def episode(self, seed: int) -> CheckedEpisode:
        ep = self.task.episode(seed)
        for method in ("prompt", "respond"):
            if not callable(getattr(ep, method, None)):
                raise TaskError(
                    f"task {self.spec!r}: episode(seed) returned {type(ep).__name__}, which has no {method}() method; "
                    "fix: return an object with prompt() and respond(response)"
                )
        return CheckedEpisode(self.spec, ep, self.vocab_size)
