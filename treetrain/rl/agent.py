"""The agent a run trains: a user's ``async def run(client, row) -> float | None``, loaded and
checked before the model. Its runs are played above this layer, against the trainer's proxy
(treetrain.trainer.agents).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from treetrain.rl.task import TaskError, _import

Agent = Callable[[Any, dict[str, Any]], Awaitable[Any]]


class AgentError(TaskError):
    """The agent cannot be loaded (exit 2, one line naming the spec and the fix)."""


def load_agent(spec: str) -> Agent:
    """``package.module:function``, an ``async def`` taking ``(client, row)``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AgentError(f"trainer.agent {spec!r} must be package.module:function (an async def run(client, row))")
    try:
        module = _import(module_name)
    except TaskError as err:
        raise AgentError(str(err).replace("task module", "agent module", 1)) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise AgentError(f"trainer.agent: module {module_name!r} has no {attr!r}; fix: name an async def in it")
    if not inspect.iscoroutinefunction(fn):
        raise AgentError(f"trainer.agent {spec!r} is not an async def; fix: define it as async def {attr}(client, row)")
    try:
        inspect.signature(fn).bind(None, {})
    except TypeError:
        raise AgentError(
            f"trainer.agent {spec!r} must take two arguments (client, row); fix: async def {attr}(client, row)"
        ) from None
    except ValueError:  # no signature to read: let the call tell
        pass
    agent: Agent = fn
    return agent
