"""Rules on what makes the episodes: a built-in task and its arguments, or a dataset with an
agent or a reward (the import strings' form, the built-in rewards' arguments), the reply length
within a conversation, and a text model where text is needed. Read by
:func:`treetrain.config.check.problems` with the other cross-section rules."""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from typing import Any

from treetrain.config import catalog
from treetrain.config.rules import Problem, Sections
from treetrain.config.tasks import BUILTIN_TASKS
from treetrain.config.trainer_settings import BUILTIN_REWARDS, IMPORT_STRING_FORM


def check_task(s: Sections) -> list[Problem]:
    t = s.trainer
    if not s.fine("trainer.task", "trainer.taskArgs"):
        return []
    spec = t.task
    if not spec.startswith("builtin:"):
        module, sep, attr = spec.partition(":")
        if not (sep and module and attr):
            return [("trainer.task", f"{spec!r} must be builtin:NAME or package.module:function")]
        return []  # a user module: imported in the trainer, which has the user's image
    name = spec.removeprefix("builtin:")
    if name not in BUILTIN_TASKS:
        known = ", ".join("builtin:" + n for n in BUILTIN_TASKS)
        return [("trainer.task", f"unknown built-in task {spec!r}; built-in: {known}")]
    task = BUILTIN_TASKS[name]
    found: list[Problem] = []
    for key in t.task_args:
        snake = "".join("_" + c.lower() if c.isupper() else c for c in key)
        if snake not in task.args:
            valid = sorted(_camel(p) for p in task.args)
            found.append((f"trainer.taskArgs.{key}", f"{spec} takes no argument {key!r}; valid: {', '.join(valid)}"))
    found += _task_arg_types(spec, task.args, t.task_args)
    needs_text = task.needs_tokenizer
    if needs_text and s.model is not None and s.fine("model.path") and catalog.random_config(s.model.path) is not None:
        found.append(
            (
                "trainer.task",
                f"{spec} works on text and needs a model with a tokenizer (e.g. model.path: builtin:smollm2-135m); "
                f"{s.model.path} has none: use builtin:parity with it",
            )
        )
    return found


def _task_arg_types(spec: str, hints: Mapping[str, Any], args: dict[str, Any]) -> list[Problem]:
    """A built-in task's arguments have the types its signature says (``turns: "2"`` would pass
    here and fail in the trainer, once the pods are up): ints are ints (not bools), floats take
    ints too, strings are strings, tuples of ints are lists of ints."""
    found: list[Problem] = []
    for key, value in args.items():
        snake = "".join("_" + c.lower() if c.isupper() else c for c in key)
        want = hints.get(snake)
        if want is None or _has_type(want, value):
            continue
        words = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
        what = words.get(want, "a list of integers" if typing.get_origin(want) is tuple else str(want))
        found.append((f"trainer.taskArgs.{key}", f"{spec} takes {what} for {key}, got {value!r}"))
    return found


def _has_type(want: Any, value: Any) -> bool:
    if want is bool:
        return isinstance(value, bool)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if want is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if want is str:
        return isinstance(value, str)
    if typing.get_origin(want) is tuple:
        (item, *_) = typing.get_args(want) or (Any,)
        return isinstance(value, list | tuple) and all(item is Any or _has_type(item, v) for v in value)
    return True  # Any, a tokenizer, ...: the task checks it


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def import_string_problem(spec: str) -> str | None:
    """Why ``spec`` is not of the form package.module:function (None: it is). Only the form:
    the module is imported by the trainer, whose image has the user's code."""
    module, sep, attr = spec.partition(":")
    parts = module.split(".")
    if sep and attr.isidentifier() and all(p.isidentifier() for p in parts):
        return None
    return f"{spec!r} must be of the form {IMPORT_STRING_FORM}"


def check_data(s: Sections) -> list[Problem]:
    """A dataset run: an agent, or a reward scoring one reply per row; never with a task of its own."""
    keys = ("trainer.agent", "trainer.dataset", "trainer.reward", "trainer.eval")
    if not s.fine(*keys):
        return []
    t = s.trainer
    found: list[Problem] = []
    if t.agent is not None:
        why = import_string_problem(t.agent)
        if why:
            found.append(("trainer.agent", f"{why}: an async function run(client, row)"))
        if t.dataset is None:
            found.append(
                ("trainer.agent", "needs trainer.dataset (the rows each agent run gets): add dataset: {path: FILE}")
            )
    if t.dataset is not None and t.agent is None and t.reward is None:
        found.append(
            (
                "trainer.reward",
                "a dataset run without an agent needs a reward to score each reply: set reward: builtin:math, "
                f"builtin:exact, builtin:regex or {IMPORT_STRING_FORM}",
            )
        )
    if t.reward is not None and t.dataset is None:
        found.append(
            (
                "trainer.reward",
                "scores replies against dataset rows, so it needs trainer.dataset: add dataset: {path: FILE}",
            )
        )
    if t.dataset is not None and s.fine("trainer.task") and "task" in t.model_fields_set:
        found.append(
            (
                "trainer.task",
                f"{t.task} and trainer.dataset both make the episodes; remove task (a dataset run has no task) or "
                "remove dataset",
            )
        )
    if t.dataset is not None and s.fine("trainer.taskArgs") and t.task_args:
        found.append(("trainer.taskArgs", "applies to trainer.task only, and a dataset run has no task; remove it"))
    if t.eval is not None and t.agent is None and t.reward is None:
        found.append(("trainer.eval", "scores replies, so it needs trainer.agent or trainer.reward; set one"))
    return found


def check_reward(s: Sections) -> list[Problem]:
    if not s.fine("trainer.reward", "trainer.rewardArgs"):
        return []
    spec, args = s.trainer.reward, s.trainer.reward_args
    if spec is None:
        return [("trainer.rewardArgs", "set without trainer.reward; remove it or set reward")] if args else []
    if not spec.startswith("builtin:"):
        why = import_string_problem(spec)
        return [("trainer.reward", f"{why}, or one of {', '.join(BUILTIN_REWARDS)}")] if why else []
    if spec not in BUILTIN_REWARDS:
        return [("trainer.reward", f"unknown built-in reward {spec!r}; built-in: {', '.join(BUILTIN_REWARDS)}")]
    takes = ("pattern",) if spec == "builtin:regex" else ()
    found: list[Problem] = [
        (
            f"trainer.rewardArgs.{key}",
            f"{spec} takes no argument {key!r}; " + (f"valid: {', '.join(takes)}" if takes else "remove it"),
        )
        for key in args
        if key not in takes
    ]
    if spec == "builtin:regex":
        pattern = args.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            found.append(("trainer.rewardArgs.pattern", "builtin:regex needs rewardArgs.pattern: a regular expression"))
        else:
            try:
                re.compile(pattern)
            except re.error as err:
                found.append(("trainer.rewardArgs.pattern", f"{pattern!r} is not a valid regular expression: {err}"))
    return found


def check_reply_length(s: Sections) -> list[Problem]:
    """Dataset prompts and agent calls reply up to maxNewTokens within one conversation of at
    most maxEpisodeTokens. Only judged where it applies (or was set): a task run has its own."""
    if not s.fine("trainer.maxNewTokens", "trainer.maxEpisodeTokens", "trainer.agent", "trainer.dataset"):
        return []
    t = s.trainer
    applies = t.agent is not None or t.dataset is not None or "max_new_tokens" in t.model_fields_set
    if applies and t.max_new_tokens > t.max_episode_tokens:
        return [
            (
                "trainer.maxNewTokens",
                f"{t.max_new_tokens} is more than trainer.maxEpisodeTokens ({t.max_episode_tokens}), so no reply "
                "fits in a conversation; lower maxNewTokens or raise maxEpisodeTokens",
            )
        ]
    return []


def check_text_model(s: Sections) -> list[Problem]:
    """Dataset prompts and agents speak text: the model needs a tokenizer and chat template."""
    if not s.fine("trainer.agent", "trainer.dataset") or s.model is None or not s.fine("model.path"):
        return []
    t = s.trainer
    if (t.agent is None and t.dataset is None) or catalog.random_config(s.model.path) is None:
        return []
    what = "trainer.agent" if t.agent is not None else "trainer.dataset"
    return [
        (
            what,
            f"works on text and needs a model with a tokenizer (e.g. model.path: builtin:smollm2-135m); "
            f"{s.model.path} has none",
        )
    ]
