"""The agent a run trains: a user's ``async def run(client, row) -> float | None``, loaded and
checked before the model. Its runs are played above this layer, against the trainer's proxy
(treetrain.trainer.agents).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from treetrain.rl.user_code import TaskError, import_spec

Agent = Callable[[Any, dict[str, Any]], Awaitable[Any]]


class AgentError(TaskError):
    """The agent cannot be loaded (exit 2, one line naming the spec and the fix)."""


def load_agent(spec: str) -> Agent:
    """``package.module:function``, an ``async def`` taking ``(client, row)``."""
    malformed = f"trainer.agent {spec!r} must be package.module:function (an async def run(client, row))"
    module_name, attr, fn = import_spec(spec, "agent", AgentError, malformed)
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
