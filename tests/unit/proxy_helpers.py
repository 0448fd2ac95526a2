"""Shared by the proxy tests: a scripted ``Generate`` (the tiny model does not call tools on
demand), a server context and plain HTTP calls that the openai SDK cannot make (no key, bad bodies)."""

from __future__ import annotations

import copy
import http.client
import itertools
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from treetrain.proxy.chat import ChatRenderer
from treetrain.proxy.server import ProxyServer, RLService
from treetrain.rl.rollout import Generation, SamplingParams

SMOL = "builtin:smollm2-135m"
QWEN_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
SCRIPTED_LOGPROB = -0.25
SCRIPTED_VERSION = 7


class Scripted:
    """A Generate that answers the k-th call with ``replies[k]`` (the last one again after the end),
    tokenized by the real tokenizer and closed by the template's end-of-turn token, as a model
    that stopped would end it. It records every call's prompts."""

    def __init__(self, renderer: ChatRenderer, replies: list[str]) -> None:
        self.renderer = renderer
        self.replies = list(replies)
        self.calls: list[list[list[int]]] = []
        self.lock = threading.Lock()

    def tokens(self, text: str) -> list[int]:
        return [*self.renderer.tokenizer.encode(text, add_special_tokens=False), self.renderer.stop_token_ids[-1]]

    def __call__(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        with self.lock:
            text = self.replies[min(len(self.calls), len(self.replies) - 1)]
            self.calls.append([list(p) for p in prompts])
        toks = self.tokens(text)[: params.max_new_tokens]
        finish = "stop" if toks[-1] in params.stop_token_ids else "length"
        return [
            Generation(
                tokens=list(toks),
                logprobs=[SCRIPTED_LOGPROB] * len(toks),
                finish_reason=finish,
                versions=[SCRIPTED_VERSION] * len(toks),
            )
            for _ in prompts
        ]


def qwen_renderer(smollm2: Any) -> ChatRenderer:
    """The Qwen2.5 chat template (tests/unit/chat_templates) on a copy of the SmolLM2 tokenizer, its tool
    tokens added as single ids: a template that renders tools and writes tool calls, as SmolLM2's does not."""
    tokenizer = copy.deepcopy(smollm2)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOOL_TOKENS})
    path = Path(__file__).parent / "chat_templates" / "qwen2.5.jinja"
    tokenizer.chat_template = path.read_text().split("\n", 1)[1]  # less the header line naming the source
    return ChatRenderer(tokenizer)


@contextmanager
def serving(generate: Any, renderer: ChatRenderer, **kwargs: Any) -> Iterator[ProxyServer]:
    """A started proxy on a free loopback port, closed afterwards."""
    request_log = kwargs.pop("request_log", None)
    server = ProxyServer(
        RLService(generate=generate, renderer=renderer, model_name=SMOL, **kwargs), request_log=request_log
    )
    server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        server.close()


def request(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    key: str | None = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    """(status, headers, decoded JSON or text) of one request on a fresh connection."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if key is not None:
            hdrs["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=data, headers=hdrs)
        res = conn.getresponse()
        text = res.read().decode()
        got = {k.lower(): v for k, v in res.getheaders()}
        try:
            return res.status, got, json.loads(text)
        except ValueError:
            return res.status, got, text
    finally:
        conn.close()


def new_session(server: ProxyServer, **body: Any) -> tuple[str, str]:
    """(id, api_key) of a new session."""
    status, _, got = request(server.url, "POST", "/rl/sessions", body)
    assert status == 200, got
    return got["id"], got["api_key"]


def samples(server: ProxyServer, sid: str, key: str) -> list[dict]:
    status, _, got = request(server.url, "GET", f"/rl/sessions/{sid}/samples", key=key)
    assert status == 200, got
    return list(got["samples"])


def check_sample(sample: dict) -> None:
    """The shape every sample has: equal lengths, the mask 1 exactly on the sampled tail, the
    prompt with log-prob 0.0 and version -1."""
    n = len(sample["input_ids"])
    assert n == len(sample["loss_mask"]) == len(sample["logprobs"]) == len(sample["versions"]), sample
    k = sum(sample["loss_mask"])
    assert k >= 1 and sample["loss_mask"] == [0] * (n - k) + [1] * k, sample["loss_mask"]
    assert sample["logprobs"][: n - k] == [0.0] * (n - k)
    assert sample["versions"][: n - k] == [-1] * (n - k)
    assert all(v >= 0 for v in sample["versions"][n - k :])


def chained(records: list[dict]) -> bool:
    """Each sample's input_ids begin with the one before's, token for token."""
    return all(b["input_ids"][: len(a["input_ids"])] == a["input_ids"] for a, b in itertools.pairwise(records))
