"""Reading tool calls and reasoning out of a sampled reply's text.

The model writes tool calls as text; agents need OpenAI ``tool_calls``. These functions are pure and never
raise on model output: text that does not parse stays content, so a broken call reaches the agent as words
rather than as an HTTP error.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_TOOL_OPEN = "<tool_call>"
# Llama 3.x writes a call as a bare JSON object, sometimes after <|python_tag|>.
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedReply:
    """The parts of one reply's text (see ``parse_reply``)."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    reasoning: str | None


def new_call_id() -> str:
    """An OpenAI-style tool-call id; random, so two calls in one session never collide."""
    return "call_" + secrets.token_hex(12)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest) for a ``<think>…</think>`` block; an unclosed block (cut by the length limit) is all
    reasoning. The template may have opened the block in the generation prompt, so a lone ``</think>`` counts."""
    stripped = text.lstrip()
    if THINK_CLOSE in text:
        head, _, rest = text.partition(THINK_CLOSE)
        head = head.lstrip()
        if head.startswith(THINK_OPEN):
            head = head[len(THINK_OPEN) :]
        return head.strip("\n"), rest.lstrip("\n")
    if stripped.startswith(THINK_OPEN):
        return stripped[len(THINK_OPEN) :].strip("\n"), ""
    return None, text


def tool_call(name: Any, arguments: Any) -> dict[str, Any] | None:
    """The OpenAI shape of one call; None when name/arguments are not what a call needs."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _call_from_json(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or set(obj) - {"name", "arguments", "parameters"} or "name" not in obj:
        return None
    return tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) from Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks (any number) or a Llama 3.x
    bare ``{"name": …, "parameters": …}`` reply. All or nothing: one broken call keeps the whole text as content."""
    bodies = _TOOL_CALL.findall(text)
    if bodies:
        calls = [_call_from_json(body.strip()) for body in bodies]
        outside = _TOOL_CALL.sub("", text)
        if _TOOL_OPEN in outside or any(call is None for call in calls):
            return text, []
        content = outside.strip()
        return content or None, [call for call in calls if call is not None]
    candidate = text.strip()
    if candidate.startswith(_PYTHON_TAG):
        candidate = candidate[len(_PYTHON_TAG) :].strip()
    if candidate.startswith("{") and candidate.endswith("}"):
        call = _call_from_json(candidate)
        if call is not None:
            return None, [call]
    return text, []


def parse_reply(text: str) -> ParsedReply:
    """Reasoning, then tool calls, from a decoded reply (stop token already removed)."""
    reasoning, rest = split_reasoning(text)
    content, calls = parse_tool_calls(rest)
    if content is None and not calls:
        content = ""
    return ParsedReply(content=content, tool_calls=calls, reasoning=reasoning or None)


def from_parsed_message(parsed: Any) -> ParsedReply | None:
    """Our shape from a ``tokenizer.parse_response`` message dict; None when it is not one we understand."""
    if not isinstance(parsed, dict):
        return None
    content = parsed.get("content")
    if content is not None and not isinstance(content, str):
        return None
    reasoning = parsed.get("thinking", parsed.get("reasoning_content", parsed.get("reasoning")))
    if reasoning is not None and not isinstance(reasoning, str):
        return None
    raw_calls = parsed.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        return None
    calls: list[dict[str, Any]] = []
    for raw in raw_calls:
        function = raw.get("function", raw) if isinstance(raw, dict) else None
        call = tool_call(function.get("name"), function.get("arguments", {})) if isinstance(function, dict) else None
        if call is None:
            return None
        calls.append(call)
    if calls and not (content or "").strip():
        content = None
    elif content is None:
        content = ""
    return ParsedReply(content=content, tool_calls=calls, reasoning=reasoning or None)
