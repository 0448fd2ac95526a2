"""OpenAI chat messages checked and reduced to what rendering reads (treetrain.proxy.chat renders them).

An SDK's echo of a reply must compare equal to the reply as recorded, so every message is brought
to one form: content one string (or None for an empty assistant reply), tool-call arguments JSON
strings, reasoning under one key.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatError(ValueError):
    """A request the renderer cannot take (the server answers 400); the message names the field."""


def _text(value: Any, where: str, *, nullable: bool) -> str | None:
    """A content field as one string: parts of type text are joined; null only where allowed."""
    if isinstance(value, str):
        return value
    if value is None:
        if nullable:
            return None
        raise ChatError(f"{where}: must be a string or a list of text parts, not null")
    if isinstance(value, list):
        texts: list[str] = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatError(f'{where}[{j}]: only {{"type": "text", "text": "..."}} parts are supported')
            texts.append(part["text"])
        return "".join(texts)
    raise ChatError(f"{where}: must be a string or a list of text parts (got {type(value).__name__})")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ChatError(f"{where}: must be a list of tool calls")
    calls: list[dict[str, Any]] = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise ChatError(f"{at}: must be an object")
        if call.get("type", "function") != "function":
            raise ChatError(f"{at}.type: only 'function' tool calls are supported")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise ChatError(f"{at}.id: must be a non-empty string")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ChatError(f"{at}.function: must be an object with name and arguments")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ChatError(f"{at}.function.name: must be a non-empty string")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise ChatError(f"{at}.function.arguments: must be a JSON string")
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def _normalize(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ChatError(f"{where}: must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise ChatError(f"{where}.role: must be one of {', '.join(ROLES)} (got {role!r})")
    out: dict[str, Any] = {"role": role}
    if role == "assistant":
        calls = _tool_calls(message.get("tool_calls"), f"{where}.tool_calls")
        content = _text(message.get("content"), f"{where}.content", nullable=True)
        out["content"] = content or None  # "" and null are the same empty reply
        if calls:
            out["tool_calls"] = calls
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ChatError(f"{where}.reasoning_content: must be a string")
            if reasoning:
                out["reasoning"] = reasoning
        return out
    if "content" not in message:
        raise ChatError(f"{where}.content: is required for role {role}")
    out["content"] = _text(message["content"], f"{where}.content", nullable=False)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ChatError(f"{where}.tool_call_id: a tool message needs the id of the call it answers")
        out["tool_call_id"] = call_id
    name = message.get("name")
    if isinstance(name, str) and name:
        out["name"] = name
    return out


def normalize_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    """Validated messages reduced to what rendering reads, so an SDK's echo of a reply compares equal to it."""
    if not isinstance(messages, list):
        raise ChatError("messages: must be a list of message objects")
    if not messages:
        raise ChatError("messages: must not be empty")
    return tuple(_normalize(message, f"messages[{i}]") for i, message in enumerate(messages))


def match_key(message: dict[str, Any]) -> dict[str, Any]:
    """What must agree for a message to be a turn's reply: reasoning may be dropped by SDKs (the sampled tokens
    hold it anyway)."""
    return {k: v for k, v in message.items() if k != "reasoning"}


def render_form(message: dict[str, Any]) -> dict[str, Any]:
    """The message as Hugging Face chat templates expect it: content a string, arguments a mapping."""
    out: dict[str, Any] = {"role": "system" if message["role"] == "developer" else message["role"]}
    out["content"] = message.get("content") or ""
    for key in ("tool_call_id", "name"):
        if key in message:
            out[key] = message[key]
    if "reasoning" in message:
        out["reasoning_content"] = message["reasoning"]
    if "tool_calls" in message:
        calls = []
        for call in message["tool_calls"]:
            arguments: Any = call["function"]["arguments"]
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                arguments = parsed
            calls.append(
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": arguments},
                }
            )
        out["tool_calls"] = calls
    return out
