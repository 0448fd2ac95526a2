"""OpenAI shapes of sampled tokens: stop strings, sample records, usage, log-probs and SSE streams.

Pure functions of the sampled tokens and the tokenizer: the server decides what to sample, this
module how the answer looks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from treetrain.proxy.chat import Reply
from treetrain.proxy.sessions import SampleRecord
from treetrain.rl.rollout import Generation

_BYTE_PROBE = " é\u4e2d"  # a space, a two-byte and a three-byte character


@dataclass(frozen=True)
class Choice:
    """One sampled reply of a chat request, read: the message, and the sampled tokens kept (after a
    stop string) with their log-probs."""

    reply: Reply
    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class Completed:
    """A chat request sampled and recorded: the id (also the sample's completion_id when one choice),
    the prompt length (a forced tool-call opening included) and the choices."""

    id: str
    prompt_len: int
    choices: list[Choice]
    usage: dict[str, Any]


def stopped(
    gen: Generation, stops: tuple[str, ...], text_of: Callable[[list[int]], str]
) -> tuple[list[int], str, str | None]:
    """(the sampled tokens kept, finish reason, the text cut at the first stop string or None).
    The tokens run up to and including the one where the stop string completes."""
    tokens = list(gen.tokens)
    if not stops:
        return tokens, gen.finish_reason, None
    full = text_of(tokens)
    hits = [i for s in stops if (i := full.find(s)) >= 0]
    if not hits:
        return tokens, gen.finish_reason, None
    at = min(hits)
    lo, hi = 1, len(tokens)  # the shortest prefix whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in text_of(tokens[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return tokens[:lo], "stop", full[:at]


def cut(reply: Reply, stops: tuple[str, ...]) -> Reply:
    content = reply.content
    if content is not None:
        hits = [i for s in stops if (i := content.find(s)) >= 0]
        content = content[: min(hits)] if hits else content
    return Reply(content=content, tool_calls=reply.tool_calls, reasoning=reply.reasoning, finish_reason="stop")


def record(completion_id: str, prompt: list[int], gen: Generation, kept: int, text: str) -> SampleRecord:
    """The trained sample: ``prompt`` (forced tool-call openings included) masked out, then exactly
    the ``kept`` tokens the model sampled, with their log-probs and weight versions."""
    n = len(prompt)
    versions = list(gen.versions[:kept]) if len(gen.versions) >= kept else [-1] * kept
    return SampleRecord(
        completion_id=completion_id,
        input_ids=[*prompt, *gen.tokens[:kept]],
        loss_mask=[0] * n + [1] * kept,
        logprobs=[0.0] * n + [float(x) for x in gen.logprobs[:kept]],
        versions=[-1] * n + versions,
        reward=None,
        text=text,
    )


def usage(prompt_len: int, records: list[SampleRecord]) -> dict[str, Any]:
    sampled = sum(sum(r.loss_mask) for r in records)
    return {"prompt_tokens": prompt_len, "completion_tokens": sampled, "total_tokens": prompt_len + sampled}


# -- log-probs ---------------------------------------------------------------------------------
@cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM2) spell each byte as one printable
    character: printable Latin-1 bytes as themselves, the other 68 bytes as the code points from 256
    on, in byte order. The inverse map gives a token's exact bytes, even half a UTF-8 character."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(extra)})
    return table


class TokenText:
    """Each token's text and bytes, as OpenAI's log-prob entries show them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_level = self._is_byte_level()

    def _is_byte_level(self) -> bool:
        try:
            ids = self.tokenizer.encode(_BYTE_PROBE, add_special_tokens=False)
            pieces = self.tokenizer.convert_ids_to_tokens(ids)
            return b"".join(self._table_bytes(p) or b"\0" for p in pieces) == _BYTE_PROBE.encode()
        except Exception:  # a tokenizer without these methods: decode each token
            return False

    @staticmethod
    def _table_bytes(piece: Any) -> bytes | None:
        table = _byte_level_table()
        if not isinstance(piece, str) or not piece or any(c not in table for c in piece):
            return None
        return bytes(table[c] for c in piece)

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = str(self.tokenizer.decode([token], skip_special_tokens=False))
        raw = None
        if self.byte_level:
            raw = self._table_bytes(self.tokenizer.convert_ids_to_tokens(token))
        if raw is None:
            raw = text.encode()
        return {"token": text, "logprob": logprob, "bytes": list(raw), "top_logprobs": []}

    def chat(self, tokens: list[int], logprobs: list[float]) -> dict[str, Any]:
        """A chat choice's ``logprobs``: one entry per sampled token (top_logprobs always empty)."""
        return {"content": [self.entry(t, float(lp)) for t, lp in zip(tokens, logprobs, strict=True)], "refusal": None}

    def legacy(self, tokens: list[int], logprobs: list[float]) -> dict[str, Any]:
        """A text completion choice's ``logprobs``; ``text_offset`` counts characters of the returned text."""
        texts = [str(self.tokenizer.decode([t], skip_special_tokens=False)) for t in tokens]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [float(x) for x in logprobs],
            "top_logprobs": None,
            "text_offset": offsets,
        }


# -- answers -----------------------------------------------------------------------------------
def chat_completion(done: Completed, model: str, token_text: TokenText | None) -> dict[str, Any]:
    """The chat.completion object; each choice's log-probs when ``token_text`` is given."""
    choices = [
        {
            "index": i,
            "message": c.reply.message(),
            "finish_reason": c.reply.finish_reason,
            "logprobs": None if token_text is None else token_text.chat(c.tokens, c.logprobs),
        }
        for i, c in enumerate(done.choices)
    ]
    return {
        "id": done.id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": done.usage,
        "system_fingerprint": None,
    }


def text_completion(cid: str, model: str, choices: list[dict[str, Any]], used: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": used,
    }


# -- streams -----------------------------------------------------------------------------------
def sse(chunks: list[dict[str, Any]]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def chat_stream(obj: dict[str, Any], include_usage: bool) -> str:
    """The whole reply as one delta per choice, then each choice's finish reason (and the usage)."""
    head = {k: obj[k] for k in ("id", "created", "model", "system_fingerprint")} | {"object": "chat.completion.chunk"}
    chunks = []
    for c in obj["choices"]:
        msg = c["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": msg["content"]}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": j, **tc} for j, tc in enumerate(msg["tool_calls"])]
        if msg.get("reasoning_content"):
            delta["reasoning_content"] = msg["reasoning_content"]
        choice = {"index": c["index"], "delta": delta, "finish_reason": None, "logprobs": c["logprobs"]}
        chunks.append(head | {"choices": [choice]})
    for c in obj["choices"]:
        end = {"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"], "logprobs": None}
        chunks.append(head | {"choices": [end]})
    if include_usage:
        chunks.append(head | {"choices": [], "usage": obj["usage"]})
    return sse(chunks)


def text_stream(obj: dict[str, Any], include_usage: bool) -> str:
    head = {k: obj[k] for k in ("id", "created", "model", "object")}
    chunks = [head | {"choices": [{**c, "finish_reason": None}]} for c in obj["choices"]]
    chunks += [
        head | {"choices": [{"index": c["index"], "text": "", "finish_reason": c["finish_reason"], "logprobs": None}]}
        for c in obj["choices"]
    ]
    if include_usage:
        chunks.append(head | {"choices": [], "usage": obj["usage"]})
    return sse(chunks)
