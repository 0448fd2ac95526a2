"""Reading OpenAI request bodies: every field is honoured, accepted as a documented no-op, or refused.

An agent that asks for something the endpoint would not do (a penalty, a JSON schema, top-k
alternatives) gets a 400 naming the field, never a reply that quietly ignored it: an RL run must
train on what the agent believes it asked for. docs/agents.md has the table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from treetrain.proxy.sessions import Refused

MAX_CHOICES = 8
MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20
# Nesting a body may have: OpenAI requests (tool schemas included) stay far below it, and deeper
# input would overflow a recursive reader (json itself at ~1,000, or the chat template) with a 500.
MAX_JSON_DEPTH = 64
# Fields that change nothing about sampling or the reply: accepted (any value) and not used.
NO_OP_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "safety_identifier",
    }
)
# Fields accepted at the value that means "off" (or OpenAI's default), refused at any other.
DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "parallel_tool_calls": (True,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "truncation": ("disabled",),
    "background": (False,),
    "include": ([],),
}
_WHY_NOT = {
    "frequency_penalty": "no sampler penalty is applied",
    "presence_penalty": "no sampler penalty is applied",
    "logit_bias": "logits are not biased",
    "parallel_tool_calls": "a reply may hold several tool calls (the sampled tokens are kept whole)",
    "echo": "the prompt is not echoed",
    "best_of": "every sample is returned and trained",
    "suffix": "no insertion",
    "truncation": "the input is never truncated",
    "background": "replies are answered in the request",
    "include": "no extra output is included",
}


class BadRequest(Refused):
    """A malformed or unsupported request (400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message)
        self.param = param


def check_fields(body: dict[str, Any], honoured: frozenset[str], route: str) -> None:
    """400 for a field this route does not honour. A null value counts as not sent (SDKs send them)."""
    for name, value in body.items():
        if value is None or name in honoured or name in NO_OP_FIELDS:
            continue
        if name in DEFAULT_ONLY:
            if value not in DEFAULT_ONLY[name] or isinstance(value, bool) != isinstance(DEFAULT_ONLY[name][0], bool):
                allowed = " or ".join(json.dumps(v) for v in DEFAULT_ONLY[name])
                raise BadRequest(
                    f"{name} {json.dumps(value)} is not supported ({_WHY_NOT[name]}): send {allowed}", name
                )
            continue
        raise BadRequest(f"{name} is not supported by {route}: drop it (docs/agents.md lists the fields)", name)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be a number from {lo:g} to {hi:g}, got {value!r}", name)
    return float(value)


def json_body(body: bytes | None, *, allow_empty: bool = False) -> dict[str, Any]:
    if not body:
        if allow_empty:
            return {}
        raise BadRequest("the request needs a JSON object body")
    too_deep = BadRequest(
        f"the body nests deeper than {MAX_JSON_DEPTH} levels; send a JSON object of messages and fields"
    )
    try:
        value = json.loads(body)
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"the body is not valid JSON ({err}); send a JSON object") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise too_deep
    if not isinstance(value, dict):
        raise BadRequest(f"the body must be a JSON object, got a JSON {type(value).__name__}")
    return value


def json_depth(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (a scalar is 0), walked without recursion."""
    if not isinstance(value, dict | list):
        return 0
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]  # containers only: a long list of numbers is one step
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise Refused(405, f"use {allowed} for this route, not {method}")


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise BadRequest(f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    return tuple(stops)


class Options:
    """The sampling options of one completion request, checked. ``length_fields``: the names of
    the reply-length field, first found wins (chat: max_completion_tokens, then max_tokens)."""

    def __init__(self, body: dict[str, Any], cap: int, length_fields: tuple[str, ...] = ("max_tokens",)) -> None:
        self.model = body.get("model")
        if self.model is not None and not isinstance(self.model, str):
            raise BadRequest("model must be a string", "model")
        self.temperature = number(body, "temperature", 1.0, 0.0, 2.0)
        self.top_p = number(body, "top_p", 1.0, 0.0, 1.0)
        if self.top_p == 0.0:
            raise BadRequest("top_p must be > 0 and <= 1", "top_p")
        self.max_tokens = cap  # the default, as ProxyLimits.max_tokens says
        for name in length_fields:
            value = body.get(name)
            if value is None:
                continue
            if not is_int(value) or value < 1:
                raise BadRequest(f"{name} must be an integer >= 1, got {value!r}", name)
            self.max_tokens = min(int(value), cap)  # above the proxy's limit: the limit
            break
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not is_int(n) or not 1 <= n <= MAX_CHOICES:
            raise BadRequest(f"n must be an integer from 1 to {MAX_CHOICES}, got {n!r}", "n")
        self.n = int(n)
        self.stop = _stops(body.get("stop"))
        seed = body.get("seed")
        if seed is not None and not is_int(seed):
            raise BadRequest(f"seed must be an integer, got {seed!r}", "seed")
        self.seed: int | None = None if seed is None else int(seed)
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest("stream must be true or false", "stream")
        self.stream = bool(stream)
        so = body.get("stream_options") or {}
        if not isinstance(so, dict) or set(so) - {"include_usage", "include_obfuscation"}:
            raise BadRequest("stream_options takes only include_usage", "stream_options")
        self.include_usage = bool(so.get("include_usage", False))


def chat_logprobs(body: dict[str, Any]) -> bool:
    """``logprobs`` / ``top_logprobs`` of a chat request: whether to return the sampled tokens' log-probs."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest("logprobs must be true or false", "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
        if not wanted:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        _no_alternatives(top, "top_logprobs")
    return bool(wanted)


def completion_logprobs(body: dict[str, Any]) -> bool:
    """``logprobs`` of a legacy completion request (an integer: how many alternatives per token)."""
    value = body.get("logprobs")
    if value is None:
        return False
    if not is_int(value) or not 0 <= value <= 5:
        raise BadRequest(f"logprobs must be an integer from 0 to 5, got {value!r}", "logprobs")
    _no_alternatives(value, "logprobs")
    return True


def _no_alternatives(k: int, name: str) -> None:
    if k > 0:
        raise BadRequest(
            f"{name} {k} is not available: the sampler returns the log-prob of each sampled token only, no top-k "
            f"alternatives; send {name}: 0",
            name,
        )


def check_response_format(value: Any, name: str = "response_format") -> None:
    """Plain text only: nothing constrains the model's output to a JSON schema."""
    if value is None or (isinstance(value, dict) and value.get("type", "text") == "text" and set(value) <= {"type"}):
        return
    kind = value.get("type") if isinstance(value, dict) else value
    raise BadRequest(
        f"{name} {json.dumps(kind)} is not supported: replies are not constrained to a format; send "
        '{"type": "text"} or leave it out and ask for JSON in the prompt',
        name,
    )


@dataclass(frozen=True)
class ToolChoice:
    """``auto`` (the model decides), ``none`` (no tools in the prompt, calls stay text), ``required``
    (the reply starts with a tool call) or ``named`` (a call of ``name``)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def tool_names(tools: list[dict[str, Any]], param: str) -> list[str]:
    """The names of chat-form function tools; 400 for any other tool."""
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            kind = tool.get("type")
            raise BadRequest(
                f"{param}[{i}]: only function tools with a name are supported (got type {kind!r})"
                if kind != "function"
                else f"{param}[{i}].function.name: a function tool needs a name",
                param,
            )
        names.append(name)
    return names


def chat_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, ToolChoice]:
    """(the tools, the tool choice) of a chat request; the named tool must be one of the tools."""
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools must be a list of tool objects", "tools")
    choice = body.get("tool_choice")
    named = None
    if isinstance(choice, dict):
        function = choice.get("function")
        named = function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None
        if not isinstance(named, str) or not named:
            raise BadRequest(
                'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}, '
                f"got {json.dumps(choice)}",
                "tool_choice",
            )
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise BadRequest(f"tool_choice must be none, auto, required or a named tool, got {choice!r}", "tool_choice")
    return tools or None, resolve_choice(tools or [], "auto" if choice is None else choice, named, "tools")


def resolve_choice(tools: list[dict[str, Any]], choice: Any, named: str | None, param: str) -> ToolChoice:
    """The checked ToolChoice: required and a named tool need tools, a name needs its tool."""
    names = tool_names(tools, param)
    if named is not None:
        if named not in names:
            raise BadRequest(
                f"tool_choice names {named!r}, which is not among the tools ({', '.join(names) or 'none given'})",
                "tool_choice",
            )
        return ToolChoice("named", named)
    if choice == "required" and not names:
        raise BadRequest("tool_choice required needs at least one tool in tools", "tool_choice")
    return ToolChoice(str(choice))
