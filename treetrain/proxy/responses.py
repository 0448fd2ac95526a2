"""``POST /v1/responses``: the Responses API (the OpenAI Agents SDK's default model) on the chat path.

A request becomes chat messages (``instructions`` a system message; each turn's reasoning, message
and ``function_call`` items one assistant message; ``function_call_output`` a tool message) and
is sampled and recorded exactly as a chat completion, so a turn that sends back the items of an
earlier response unchanged extends that response's tokens exactly. Output items come back the other
way (``stream: true``: the same Response as server-sent events, the whole text in one delta).
Nothing is stored between requests: the whole conversation comes in ``input`` each time.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from treetrain.proxy.options import BadRequest, Options, ToolChoice, check_fields, check_response_format, resolve_choice
from treetrain.proxy.shaping import Completed

FIELDS = frozenset(
    {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p"}
    | {"stream", "text"}
)
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_REFUSED = {
    "previous_response_id": "responses are not stored: send the whole conversation in input (the Agents SDK does "
    "unless told to chain by id)",
    "conversation": "conversations are not stored: send the whole conversation in input",
    "prompt": "stored prompts are not available: send instructions and input",
    "reasoning": "the model's chat template decides whether it reasons; drop reasoning",
    "max_tool_calls": "the number of tool calls in a reply is not limited",
    "top_logprobs": "log-probs come with /v1/chat/completions (logprobs: true) or GET /rl/sessions/{id}/samples",
}


@dataclass
class Call:
    """A Responses request as the chat path takes it, and what the Response object echoes."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    choice: ToolChoice
    options: Options
    stream: bool = False
    echo: dict[str, Any] = field(default_factory=dict)


def parse(body: dict[str, Any], cap: int) -> Call:
    """The checked request; 400 naming the field for what is not supported."""
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise BadRequest(f"{name} is not supported by /v1/responses: {why}", name)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    check_fields(body, FIELDS, "/v1/responses")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format"}:
            raise BadRequest('text takes only {"format": {"type": "text"}} (no verbosity)', "text")
        check_response_format(text.get("format"), "text.format")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string", "instructions")
    tools = _tools(body.get("tools"))
    choice_value = body.get("tool_choice")
    named = _named_choice(choice_value)
    choice = resolve_choice(tools, "auto" if choice_value is None else choice_value, named, "tools")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + _messages(body.get("input"))
    options = Options({k: body.get(k) for k in ("model", "temperature", "top_p", "max_output_tokens")}, cap,
                      ("max_output_tokens",))  # fmt: skip
    echo = {
        "instructions": instructions,
        "tools": body.get("tools") or [],
        "tool_choice": choice_value if choice_value is not None else "auto",
        "temperature": options.temperature,
        "top_p": options.top_p,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "user": body.get("user"),
    }
    return Call(messages, tools or None, choice, options, bool(stream), echo)


def _tools(value: Any) -> list[dict[str, Any]]:
    """The Responses function tools (flat: type, name, description, parameters, strict) in chat form."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRequest("tools must be a list of tool objects", "tools")
    tools = []
    for i, tool in enumerate(value):
        kind = tool.get("type")
        if kind != "function":
            raise BadRequest(f"tools[{i}]: built-in tool type {kind!r} is not supported: only function tools", "tools")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"tools[{i}].name: a function tool needs a name", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        tools.append({"type": "function", "function": function})
    return tools


def _named_choice(value: Any) -> str | None:
    if value is None or value in ("auto", "none", "required"):
        return None
    name = value.get("name") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(name, str) or not name:
        raise BadRequest(
            'tool_choice must be auto, none, required or {"type": "function", "name": ...} (no built-in or '
            f"allowed_tools choices), got {json.dumps(value)}",
            "tool_choice",
        )
    return name


def _text(content: Any, where: str) -> str:
    """A content field (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") not in _TEXT_PARTS
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}[{j}]: only text parts are supported (got {kind!r})", "input")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"{where}: must be a string or a list of text parts", "input")


def _messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: an assistant turn's consecutive output items merge into one message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being assembled

    def assistant(starts_new: bool) -> dict[str, Any]:
        nonlocal turn
        if turn is None or starts_new:
            turn = {"role": "assistant", "content": None}
            messages.append(turn)
        return turn

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where}: must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            current = assistant(turn is None or bool(turn["content"]) or "tool_calls" in turn)
            current["content"] = _text(item.get("content"), f"{where}.content") or None
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            current = assistant(turn is None or bool(turn["content"]) or "tool_calls" in turn)
            current["reasoning_content"] = _text(parts, f"{where}.content") or None
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(x, str) and x for x in (call_id, name)) or not isinstance(arguments, str):
                raise BadRequest(f"{where}: a function_call needs call_id, name and arguments (strings)", "input")
            function = {"name": name, "arguments": arguments}
            assistant(False).setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": function}
            )
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequest(f"{where}.call_id: a function_call_output needs the call_id it answers", "input")
            turn = None
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), where)})
        elif kind == "message" and item.get("role") in _MESSAGE_ROLES:
            turn = None
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
        else:
            what = f"role {item.get('role')!r}" if kind == "message" else f"type {kind!r}"
            raise BadRequest(
                f"{where}: items of {what} are not supported (messages, function_call, function_call_output, "
                "reasoning)",
                "input",
            )
    return messages


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def response_object(call: Call, done: Completed, model: str) -> dict[str, Any]:
    """The Response: reasoning, message and function_call output items of the one choice, and usage.
    A reply cut by the length limit is ``incomplete`` (reason max_output_tokens), as OpenAI's are."""
    (choice,) = done.choices
    reply = choice.reply
    cut_short = reply.finish_reason == "length"
    status = "incomplete" if cut_short else "completed"
    output: list[dict[str, Any]] = []
    if reply.reasoning:
        reasoning = [{"type": "reasoning_text", "text": reply.reasoning}]
        output.append({"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": reasoning})
    if reply.content or not reply.tool_calls:
        text = {"type": "output_text", "text": reply.content or "", "annotations": [], "logprobs": []}
        message = {"type": "message", "id": _item_id("msg"), "role": "assistant", "status": status, "content": [text]}
        output.append(message)
    for tc in reply.tool_calls:
        function = tc["function"]
        output.append(
            {
                "type": "function_call",
                "id": _item_id("fc"),
                "call_id": tc["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    used = done.usage
    return {
        "id": done.id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "usage": {
            "input_tokens": used["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": used["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": used["total_tokens"],
        },
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut_short else None,
        "parallel_tool_calls": True,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        **call.echo,
    }


def event_stream(obj: dict[str, Any]) -> str:
    """The Response as the Responses API streams one: created, in progress, each output item added
    (a message's whole text, a call's whole arguments in one delta) and done, then completed (or
    incomplete) with the whole Response."""
    numbers = itertools.count()
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": next(numbers), **fields})

    head = obj | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=head)
    emit("response.in_progress", response=head)
    for i, item in enumerate(obj["output"]):
        if item["type"] == "message":
            emit("response.output_item.added", output_index=i, item=item | {"status": "in_progress", "content": []})
            part = item["content"][0]
            at = {"item_id": item["id"], "output_index": i, "content_index": 0}
            emit("response.content_part.added", **at, part=part | {"text": ""})
            emit("response.output_text.delta", **at, delta=part["text"], logprobs=[])
            emit("response.output_text.done", **at, text=part["text"], logprobs=[])
            emit("response.content_part.done", **at, part=part)
        elif item["type"] == "function_call":
            emit("response.output_item.added", output_index=i, item=item | {"status": "in_progress", "arguments": ""})
            at = {"item_id": item["id"], "output_index": i}
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, arguments=item["arguments"], name=item["name"])
        else:  # reasoning: added whole
            emit("response.output_item.added", output_index=i, item=item)
        emit("response.output_item.done", output_index=i, item=item)
    emit("response.completed" if obj["status"] == "completed" else "response.incomplete", response=obj)
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
