"""The built-in tasks as config validation sees them: names, argument names and types, and
whether the task needs the model's tokenizer. Torch-free and free of the tasks' code: the
constructors live in :data:`treetrain.rl.task.BUILTIN_TASKS`, which sits above config;
tests/unit/test_config.py checks that both name the same tasks with the same arguments."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BuiltinTask:
    # snake_case argument -> its type (int, float, str, tuple[int, ...]); never the tokenizer
    args: Mapping[str, Any]
    needs_tokenizer: bool  # the task works on text: it takes the model's tokenizer and cannot run without one


BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "arithmetic": BuiltinTask(
        args={"turns": int, "max_operand": int, "max_new_tokens": int, "system": str},
        needs_tokenizer=True,
    ),
    "parity": BuiltinTask(
        args={
            "vocab_size": int,
            "turns": int,
            "user_tokens": int,
            "system_tokens": int,
            "max_new_tokens": int,
            "even_share": float,
            "stop_token_ids": tuple[int, ...],
        },
        needs_tokenizer=False,
    ),
}
