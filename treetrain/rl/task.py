"""Tasks: multi-turn environments with a programmatic reward, in token ids.

A task makes *episodes*. An episode starts with a prompt (token ids), takes the policy's
response, and answers with the next user turn (or ``None`` when it is over) and that turn's
reward. Every turn becomes one training sample holding the whole conversation so far, so
the samples of one episode, and of the episodes that share the system prompt, form a tree.

User tasks plug in through ``trainer.task: "package.module:function"``: the function takes
the ``trainer.taskArgs`` mapping as keyword arguments and returns a :class:`Task`.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class TaskError(ValueError):
    """A task that cannot be loaded or built; the message says what to change."""


class Episode(Protocol):
    def prompt(self) -> list[int]:
        """The first prompt (system prompt and first user turn)."""

    def respond(self, response: list[int]) -> tuple[list[int] | None, float]:
        """Take the policy's response; return the next user turn (``None``: done) and its reward."""


class Task(Protocol):
    vocab_size: int
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]

    def episode(self, seed: int) -> Episode:
        """A fresh episode; the same seed gives the same episode (a GRPO group shares one)."""


# Special ids of the built-in task (below FIRST_WORD); words are FIRST_WORD..vocab-1.
BOS, USER, ASSISTANT, EVEN, ODD = 1, 2, 3, 4, 5
FIRST_WORD = 8


@dataclass
class ParityEpisode:
    task: ParityTask
    rng: random.Random
    turn: int = 0
    _want: int = 0

    def _user_turn(self) -> list[int]:
        words = [self.rng.randrange(FIRST_WORD, self.task.vocab_size) for _ in range(self.task.user_tokens)]
        self._want = 0 if self.rng.random() < self.task.even_share else 1
        return [USER, *words, EVEN if self._want == 0 else ODD, ASSISTANT]

    def prompt(self) -> list[int]:
        return [*self.task.system_prompt, *self._user_turn()]

    def respond(self, response: list[int]) -> tuple[list[int] | None, float]:
        reward = sum(1 for t in response if t % 2 == self._want) / max(len(response), 1)
        self.turn += 1
        if self.turn >= self.task.turns:
            return None, reward
        return self._user_turn(), reward


@dataclass
class ParityTask:
    """Built-in: each user turn ends with EVEN or ODD; the reward is the fraction of the
    response's tokens with that parity. A fixed system prompt is shared by every episode,
    each episode has ``turns`` turns, and every turn is one sample: shaped like agent traces,
    so tree packing has prefixes to share. A random policy scores about 0.5; one that learns
    how often EVEN comes (``even_share``) scores ``max(even_share, 1 - even_share)``; one that
    reads the instruction scores 1."""

    vocab_size: int = 512
    turns: int = 4
    user_tokens: int = 12
    system_tokens: int = 96
    max_new_tokens: int = 16
    even_share: float = 0.5  # how often a turn asks for EVEN (above 0.5 a bias alone scores above 0.5)
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.even_share <= 1.0:
            raise TaskError(f"taskArgs.even_share must be in [0, 1], got {self.even_share!r}")
        for name in ("turns", "user_tokens", "system_tokens", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TaskError(f"taskArgs.{name} must be a positive integer, got {value!r}")
        if self.vocab_size <= FIRST_WORD + 1:
            raise TaskError(f"taskArgs.vocab_size must be > {FIRST_WORD + 1}, got {self.vocab_size!r}")
        rng = random.Random(1234)
        self.system_prompt = [BOS] + [rng.randrange(FIRST_WORD, self.vocab_size) for _ in range(self.system_tokens - 1)]

    def episode(self, seed: int) -> ParityEpisode:
        return ParityEpisode(task=self, rng=random.Random(seed))


BUILTIN_TASKS: dict[str, Callable[..., Task]] = {"parity": ParityTask}


def load_task(spec: str, args: dict[str, Any]) -> Task:
    """``builtin:parity`` or ``package.module:function``; ``args`` become keyword arguments."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN_TASKS:
            raise TaskError(
                f"unknown built-in task {spec!r}; built-in: {', '.join('builtin:' + n for n in BUILTIN_TASKS)}"
            )
        factory = BUILTIN_TASKS[name]
        # Built-in tasks take camelCase keys too, like the rest of the config.
        args = {"".join("_" + c.lower() if c.isupper() else c for c in k): v for k, v in args.items()}
    else:
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr:
            raise TaskError(f"task {spec!r} must be builtin:NAME or package.module:function")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise TaskError(f"cannot import task module {module_name!r}: {err}") from None
        found = getattr(module, attr, None)
        if not callable(found):
            raise TaskError(f"{module_name!r} has no callable {attr!r}")
        factory = found
    try:
        task = factory(**args)
    except TypeError as err:
        raise TaskError(f"task {spec!r} rejected taskArgs {sorted(args)}: {err}") from None
    for field in ("vocab_size", "max_new_tokens", "episode"):
        if not hasattr(task, field):
            raise TaskError(f"task {spec!r} returned {type(task).__name__}, which lacks {field!r}")
    return task
