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
from treetrain.proxy.messages import ChatError as ChatError
from treetrain.proxy.messages import match_key, render_form
from treetrain.proxy.messages import normalize_messages as normalize_messages
from treetrain.proxy.tools import ParsedReply, from_parsed_message, parse_reply, split_reasoning

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
_PROBE_TOOL, _PROBE_ARG = "treetrain_probe_tool", "treetrain_probe_arg"
# The call syntax the reply parser reads (Hermes/Qwen), for templates that write no tool calls (SmolLM2).
HERMES_CALL_OPENING = ('<tool_call>\n{"name": "', '", "arguments":')
# Enough sampled tokens to hold an end-of-turn marker even when it tokenizes as plain text.
_TAIL_TOKENS = 32


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
        self._call_opening = self._find_call_opening()

    # -- template access

    def _render(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation: bool
    ) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ChatError("messages: this model has no chat template; use /v1/completions with a text prompt")
        try:
            text = self.tokenizer.apply_chat_template(
                [render_form(m) for m in messages], tools=tools, add_generation_prompt=generation, tokenize=False
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

    def _find_call_opening(self) -> tuple[str, str]:
        """(what starts a reply that is one tool call, up to the function's name; what follows the name up to the
        arguments), read off the template by rendering a probe call; HERMES_CALL_OPENING when it writes none."""
        schema = {"type": "object", "properties": {_PROBE_ARG: {"type": "integer"}}}
        tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe", "parameters": schema}}
        function = {"name": _PROBE_TOOL, "arguments": json.dumps({_PROBE_ARG: 1})}
        call = {"id": "call_probe", "type": "function", "function": function}
        user = {"role": "user", "content": "hi"}
        reply = {"role": "assistant", "content": None, "tool_calls": [call]}
        try:
            prompt = self._render((user,), [tool], generation=True)
            whole = self._render((user, reply), [tool], generation=False)
        except (ChatError, _TemplateRefused):
            return HERMES_CALL_OPENING
        head, found, rest = (whole[len(prompt) :] if whole.startswith(prompt) else "").partition(_PROBE_TOOL)
        if not found or not head.strip():
            return HERMES_CALL_OPENING
        arg = rest.find(_PROBE_ARG)
        brace = rest.rfind("{", 0, arg) if arg >= 0 else -1
        # No trailing space: the model writes it with the next token, as it was trained to (" {").
        return head, (rest[:brace] if brace >= 0 else "").rstrip(" ")

    def call_opening(self, name: str | None) -> tuple[str, list[int]]:
        """(text, ids) a forced tool call starts the reply with: the opening up to the function's name, and for
        a named tool its name and what comes before the arguments. The ids are prompt: the model samples on."""
        head, middle = self._call_opening
        text = head if name is None else head + name + middle
        return text, self._encode(text)

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
            if len(normalized) <= n + 1 or match_key(normalized[n]) != match_key(turn.reply):
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

    def reply(self, tokens: list[int], finish_reason: str, *, tools: bool = True) -> Reply:
        """The assistant message for sampled tokens (the trailing stop token is not text). ``tools=False`` (no
        tools offered, or tool_choice none): reasoning is read, tool calls stay text."""
        body = list(tokens)
        if body and body[-1] in self.stop_token_ids:
            body.pop()
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        if not tools:
            reasoning, rest = split_reasoning(text)
            return Reply(content=rest, tool_calls=[], reasoning=reasoning or None, finish_reason=finish_reason)
        parsed = self._parse(text)
        finish = "tool_calls" if parsed.tool_calls else finish_reason
        return Reply(
            content=parsed.content, tool_calls=parsed.tool_calls, reasoning=parsed.reasoning, finish_reason=finish
        )
