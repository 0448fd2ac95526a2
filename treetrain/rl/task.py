"""Tasks: multi-turn environments with a programmatic reward, in token ids.

A task makes *episodes*. An episode starts with a prompt (token ids), takes the policy's
response, and answers with the next user turn (or ``None`` when it is over) and that turn's
reward. Every turn becomes one training sample holding the whole conversation so far, so
the samples of one episode, and of the episodes that share the system prompt, form a tree.

Built-in: ``builtin:arithmetic`` (text, through the model's tokenizer and chat template; the
embedded default) and ``builtin:parity`` (raw token ids, for models without a tokenizer).

User tasks plug in through ``trainer.task: "package.module:function"``: the function takes
the ``trainer.taskArgs`` mapping as keyword arguments (plus ``tokenizer=``, the model's
tokenizer, when it has a parameter of that name) and returns a :class:`Task`.
"""

from __future__ import annotations

import inspect
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from treetrain.rl.user_code import CheckedTask, TaskError, check_declared, first_line, import_spec

__all__ = ["BUILTIN_TASKS", "ArithmeticTask", "Episode", "ParityTask", "Task", "TaskError", "load_task"]


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
        _check_sizes(self, ("turns", "user_tokens", "system_tokens", "max_new_tokens"))
        if self.vocab_size <= FIRST_WORD + 1:
            raise TaskError(f"taskArgs.vocab_size must be > {FIRST_WORD + 1}, got {self.vocab_size!r}")
        rng = random.Random(1234)
        self.system_prompt = [BOS] + [rng.randrange(FIRST_WORD, self.vocab_size) for _ in range(self.system_tokens - 1)]

    def episode(self, seed: int) -> ParityEpisode:
        return ParityEpisode(task=self, rng=random.Random(seed))


MAX_TASK_SIZE = 65536  # turns and token counts: a typo (maxNewTokens: 1e9) must not run for ever


def _check_sizes(task: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(task, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TASK_SIZE:
            raise TaskError(f"taskArgs.{name} must be an integer in 1..{MAX_TASK_SIZE}, got {value!r}")


class ChatTemplate:
    """Renders a conversation turn by turn, in token ids, with a tokenizer's chat template.

    The policy's replies are its own sampled tokens, so a conversation is built by appending:
    the first prompt (system + user + the assistant header), then after each reply the text
    that closes it and the next user turn. Both pieces come from the template itself, by
    rendering a short conversation and cutting it where a turn starts or a reply ends.
    """

    _MARK = "\u00a7"  # a stand-in reply, to find where a reply ends in the rendered text

    def __init__(self, tokenizer: Any, system: str) -> None:
        self.tokenizer = tokenizer
        self.system = system
        render = self._render
        system_only = render([("system", system)], prompt=False)
        with_user = render([("system", system), ("user", "x")], prompt=True)
        if not with_user.startswith(system_only):
            raise TaskError("the tokenizer's chat template does not render turns incrementally; use builtin:parity")
        replied = render([("system", system), ("user", "x"), ("assistant", self._MARK)], prompt=False)
        self._reply_end = replied[replied.index(self._MARK) + len(self._MARK) :]
        self._eos_text = tokenizer.eos_token or ""
        self._system_only_len = len(system_only)

    def _render(self, turns: list[tuple[str, str]], *, prompt: bool) -> str:
        messages = [{"role": role, "content": content} for role, content in turns]
        text: str = self.tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        return text

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def first(self, user: str) -> list[int]:
        return self.encode(self._render([("system", self.system), ("user", user)], prompt=True))

    def next(self, user: str, reply: list[int]) -> list[int]:
        """What follows a reply: its closing text (less the end token the policy already
        sampled, when it stopped on it) and the next user turn with the assistant header."""
        user_turn = self._render([("system", self.system), ("user", user)], prompt=True)[self._system_only_len :]
        closing = self._reply_end
        if reply and reply[-1] == self.tokenizer.eos_token_id and closing.startswith(self._eos_text):
            closing = closing[len(self._eos_text) :]
        return self.encode(closing + user_turn)

    def decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text


ARITHMETIC_SYSTEM = (
    "You are a quick calculator in a quiz. The user asks one sum at a time. "
    "Answer each question with the result only, as digits, with no words."
)


@dataclass
class ArithmeticEpisode:
    task: ArithmeticTask
    rng: random.Random
    turn: int = 0
    _answer: int = 0

    def _question(self) -> str:
        a, b = (self.rng.randint(1, self.task.max_operand) for _ in range(2))
        self._answer = a + b
        return f"What is {a} + {b}?"

    def prompt(self) -> list[int]:
        return self.task.chat.first(self._question())

    def respond(self, response: list[int]) -> tuple[list[int] | None, float]:
        reward = self.task.score(self.task.chat.decode(response), self._answer)
        self.turn += 1
        if self.turn >= self.task.turns:
            return None, reward
        return self.task.chat.next(self._question(), response), reward


@dataclass
class ArithmeticTask:
    """Built-in, in text: a quiz session of ``turns`` sums (``What is 7 + 5?``), one user turn
    each, under one shared system prompt, rendered with the model's chat template; every turn
    is one sample holding the whole session so far, so sessions form trees the way agent
    traces do. A reply scores 1 when the sum is its only number, 0.5 when the sum is among
    other numbers (``7 + 5 = 12``), else 0."""

    tokenizer: Any
    turns: int = 3
    max_operand: int = 9
    max_new_tokens: int = 16
    system: str = ARITHMETIC_SYSTEM

    def __post_init__(self) -> None:
        _check_sizes(self, ("turns", "max_operand", "max_new_tokens"))
        self.chat = ChatTemplate(self.tokenizer, self.system)
        self.vocab_size = len(self.tokenizer)
        eos = self.tokenizer.eos_token_id
        self.stop_token_ids: tuple[int, ...] = (eos,) if eos is not None else ()

    @staticmethod
    def score(reply: str, answer: int) -> float:
        numbers = [int(n) for n in re.findall(r"-?\d+", reply)]
        if answer not in numbers:
            return 0.0
        return 1.0 if len(numbers) == 1 else 0.5

    def episode(self, seed: int) -> ArithmeticEpisode:
        return ArithmeticEpisode(task=self, rng=random.Random(seed))


BUILTIN_TASKS: dict[str, Callable[..., Task]] = {"arithmetic": ArithmeticTask, "parity": ParityTask}


def load_task(spec: str, args: dict[str, Any], get_tokenizer: Callable[[], Any] | None = None) -> Task:
    """``builtin:NAME`` or ``package.module:function``; ``args`` become keyword arguments.
    Tasks that take a ``tokenizer`` get ``get_tokenizer()`` (the model's; None for models
    without one), loaded only for them; a task that requires one refuses a model without."""
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
        malformed = f"task {spec!r} must be builtin:NAME or package.module:function"
        module_name, attr, found = import_spec(spec, "task", TaskError, malformed)
        if not callable(found):
            raise TaskError(f"{module_name!r} has no callable {attr!r}")
        factory = found
    takes = _parameters(factory)
    if "tokenizer" in takes and "tokenizer" not in args:
        tokenizer = get_tokenizer() if get_tokenizer is not None else None
        if tokenizer is None and takes["tokenizer"].default is inspect.Parameter.empty:
            raise TaskError(
                f"task {spec!r} works on text and needs a model with a tokenizer (e.g. model.path: "
                "builtin:smollm2-135m); random built-in models have none: use builtin:parity with them"
            )
        args = {**args, "tokenizer": tokenizer}
    given = sorted(k for k in args if k != "tokenizer")
    try:
        task = factory(**args)
    except TaskError:
        raise
    except TypeError as err:
        raise TaskError(f"task {spec!r} rejected taskArgs {given}: {err}") from None
    except Exception as err:  # the task's own code: one line, not a traceback (exit 2)
        raise TaskError(
            f"task {spec!r} failed to build with taskArgs {given}: {type(err).__name__}: {first_line(err)}; "
            "fix: correct trainer.taskArgs or the task's code"
        ) from None
    for field in ("vocab_size", "max_new_tokens", "episode"):
        if not hasattr(task, field):
            raise TaskError(f"task {spec!r} returned {type(task).__name__}, which lacks {field!r}")
    if spec.startswith("builtin:"):
        return task
    return CheckedTask(spec, check_declared(spec, task, MAX_TASK_SIZE))


def _parameters(factory: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some builtins have no signature
        return {}
