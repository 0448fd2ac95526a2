"""Token in, token out: chat messages to prompt tokens and sampled tokens to an assistant message.

Training needs the exact tokens the model sampled. Re-rendering a conversation and re-tokenizing the model's
own replies can give other tokens (other splits, reformatted tool calls), so a request that extends an
earlier completion reuses that completion's prompt and sampled ids verbatim and renders only what is new.
Whether the template renders incrementally is read off the template itself, by rendering and cutting text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treetrain.metrics import FRESH_REASONS as FRESH_REASONS  # the label values: one tuple, in metrics
from treetrain.proxy.tools import ParsedReply, from_parsed_message, parse_reply

ROLES = ("system", "developer", "user", "assistant", "tool")
# End-of-turn tokens of the model families the engines serve; the sampler stops on those in the vocabulary.
# (Their generation configs stop on the end-of-text token as well: Qwen2.5 on <|endoftext|>, Llama 3.1 on
# <|end_of_text|>.)
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
)
_SENTINEL = "\u2063treetrain-sentinel\u2063"
# Enough sampled tokens to hold an end-of-turn marker even when it tokenizes as plain text.
_TAIL_TOKENS = 32


class ChatError(ValueError):
    """A request the renderer cannot take (the server answers 400); the message names the field."""


@dataclass(frozen=True)
class Turn:
    """One recorded completion, as the session keeps it."""

    messages: tuple[dict[str, Any], ...]  # the request's messages, normalized
    reply: dict[str, Any]  # the assistant message returned, normalized
    tokens: tuple[int, ...]  # prompt tokens + sampled tokens


@dataclass(frozen=True)
class Prompt:
    """The tokens to sample from, and whether they extend a recorded turn (the trainer packs shared prefixes)."""

    tokens: list[int]
    parent: int | None  # index in history of the Turn this extends; None: a fresh render
    fresh_reason: str | None  # None, or one of FRESH_REASONS


@dataclass(frozen=True)
class Reply:
    """What the sampled tokens say, in the OpenAI message's terms."""

    content: str | None
    tool_calls: list[dict[str, Any]]  # {"id", "type": "function", "function": {"name", "arguments": str}}
    reasoning: str | None
    finish_reason: str  # "stop" | "tool_calls" | "length"

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message; reasoning goes in ``reasoning_content`` (what vLLM and DeepSeek send)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(call, function=dict(call["function"])) for call in self.tool_calls]
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        return out


# ---------------------------------------------------------------- normalization


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


def _match_key(message: dict[str, Any]) -> dict[str, Any]:
    """What must agree for a message to be a turn's reply: reasoning may be dropped by SDKs (the sampled tokens
    hold it anyway)."""
    return {k: v for k, v in message.items() if k != "reasoning"}


def _render_form(message: dict[str, Any]) -> dict[str, Any]:
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


# ---------------------------------------------------------------- the renderer


class _TemplateRefused(Exception):
    pass


class ChatRenderer:
    """Prompts for chat requests and assistant messages for sampled tokens, with one model's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._end_of_turn = self._find_end_of_turn()
        self._generation_prompt = self._find_generation_prompt()
        self.stop_token_ids: tuple[int, ...] = self._find_stop_ids()

    # -- template access

    def _render(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation: bool
    ) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ChatError("messages: this model has no chat template; use /v1/completions with a text prompt")
        try:
            text = self.tokenizer.apply_chat_template(
                [_render_form(m) for m in messages], tools=tools, add_generation_prompt=generation, tokenize=False
            )
        except Exception as err:  # jinja raises TemplateError and whatever the template's own checks raise
            raise _TemplateRefused(str(err)) from None
        if not isinstance(text, str):
            raise _TemplateRefused(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def _encode(self, text: str) -> list[int]:
        # Templates write their own BOS; adding special tokens here would double it.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _find_end_of_turn(self) -> str:
        """The text the template writes after an assistant message's content (e.g. "<|im_end|>\\n")."""
        probe = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL})
        try:
            text = self._render(probe, None, generation=False)
        except (ChatError, _TemplateRefused):
            return ""
        _, found, after = text.rpartition(_SENTINEL)
        return after if found else ""

    def _find_generation_prompt(self) -> str:
        """What the template writes to open the reply (e.g. "<|im_start|>assistant\\n<think>\\n"): the context a
        response parser needs to read a reply that starts inside a block the prompt opened."""
        probe = ({"role": "user", "content": _SENTINEL},)
        try:
            without = self._render(probe, None, generation=False)
            with_prompt = self._render(probe, None, generation=True)
        except (ChatError, _TemplateRefused):
            return ""
        return with_prompt[len(without) :] if with_prompt.startswith(without) else ""

    def _find_stop_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.append(eos)
        vocab = self.tokenizer.get_added_vocab() if hasattr(self.tokenizer, "get_added_vocab") else {}
        for token, token_id in vocab.items():
            marks_end = token in END_OF_TURN_TOKENS or (self._end_of_turn and self._end_of_turn.startswith(token))
            if marks_end and token_id not in ids and len(token) > 1:
                ids.append(token_id)
        return tuple(ids)

    # -- prompts

    def fresh(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The whole conversation rendered with the generation prompt."""
        try:
            return self._encode(self._render(messages, tools, generation=True))
        except _TemplateRefused as err:
            raise ChatError(f"messages: the model's chat template cannot render them ({err})") from None

    def _closing(self, tokens: Sequence[int]) -> str:
        """The end-of-turn text less what the sample already ends with: the sampler keeps the stop token, and a
        marker that is no single token here (a foreign template) may have been sampled as text."""
        end = self._end_of_turn
        marker = end.rstrip()
        if marker and self.tokenizer.decode(list(tokens[-_TAIL_TOKENS:]), skip_special_tokens=False).endswith(marker):
            return end[len(marker) :]
        if tokens and tokens[-1] in self.stop_token_ids:
            last = self.tokenizer.decode([tokens[-1]], skip_special_tokens=False)
            if last and end.startswith(last):
                return end[len(last) :]
        return end

    def _extend(
        self, turn: Turn, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int] | None:
        """turn.tokens + closing + new when the template renders the longer conversation as a text suffix."""
        head = (*turn.messages, turn.reply)
        try:
            before = self._render(head, tools, generation=False)
            after = self._render((*head, *messages[len(head) :]), tools, generation=True)
        except _TemplateRefused:
            return None
        if after.startswith(before) and self._end_of_turn and before.endswith(self._end_of_turn):
            return [*turn.tokens, *self._encode(self._closing(turn.tokens) + after[len(before) :])]
        # The reply rendered as the last message differs from the reply inside a longer conversation (Qwen3 writes
        # an empty <think> block only for the last one). Still exact when the whole conversation rendered fresh
        # starts with the text of the recorded ids: then only the rest is new.
        recorded = self.tokenizer.decode(list(turn.tokens), skip_special_tokens=False)
        if after.startswith(recorded):
            return [*turn.tokens, *self._encode(after[len(recorded) :])]
        return None

    def prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, history: Sequence[Turn]
    ) -> Prompt:
        """Prompt tokens for ``messages`` (normalized), extending the latest turn they continue."""
        normalized = normalize_messages(list(messages))  # idempotent: normalized input stays as it is
        tools = tools or None  # templates test "tools is not none": an empty list would still switch tool mode on
        for index in range(len(history) - 1, -1, -1):
            turn = history[index]
            n = len(turn.messages)
            if len(normalized) <= n + 1 or _match_key(normalized[n]) != _match_key(turn.reply):
                continue
            if normalized[:n] != turn.messages:
                continue
            tokens = self._extend(turn, normalized, tools)
            if tokens is None:
                return Prompt(self.fresh(normalized, tools), None, "template")
            return Prompt(tokens, index, None)
        edited = any(m["role"] == "assistant" for m in normalized)
        return Prompt(self.fresh(normalized, tools), None, "edited" if edited else None)

    def render_text_prompt(self, prompt: str) -> list[int]:
        """/v1/completions: the text as the tokenizer encodes it by default (BOS where the model wants one)."""
        return list(self.tokenizer.encode(prompt))

    # -- replies

    def _parse(self, text: str) -> ParsedReply:
        """The tokenizer's own response parser when it defines one (transformers ``response_template``), else ours."""
        if getattr(self.tokenizer, "response_template", None) is not None and hasattr(self.tokenizer, "parse_response"):
            try:
                parsed = from_parsed_message(self.tokenizer.parse_response(text, prefix=self._generation_prompt))
            except Exception:  # a parser failing on model output must not fail the request
                parsed = None
            if parsed is not None:
                return parsed
        return parse_reply(text)

    def reply(self, tokens: list[int], finish_reason: str) -> Reply:
        """The assistant message for sampled tokens (the trailing stop token is not text)."""
        body = list(tokens)
        if body and body[-1] in self.stop_token_ids:
            body.pop()
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        parsed = self._parse(text)
        finish = "tool_calls" if parsed.tool_calls else finish_reason
        return Reply(
            content=parsed.content, tool_calls=parsed.tool_calls, reasoning=parsed.reasoning, finish_reason=finish
        )
