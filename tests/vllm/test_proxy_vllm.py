"""The proxy backed by the REAL vLLM server (conftest.py's, SmolLM2-135M): a 2-turn chat through
the openai SDK; the samples chain token for token and carry the server's log-probs and the
weight version it sampled with."""

from __future__ import annotations

from typing import Any

from openai import OpenAI
from real_vllm import VLLMServer

from treetrain.engines import builtin
from treetrain.proxy.chat import ChatRenderer
from treetrain.proxy.server import ProxyServer, RLService
from treetrain.rl.rollout import VLLMRollout

VERSION = 3  # the weights reloaded under this version before the chat


def test_two_turn_chat_through_the_proxy_on_real_vllm(vllm: VLLMServer) -> None:
    client = VLLMRollout(endpoints=[vllm.url])
    client.wait_ready(60)
    with client.gate.update(VERSION):  # as the trainer syncs: the model's own weights, from disk, as version 3
        client.update_weights(str(vllm.model), VERSION)
    renderer = ChatRenderer(builtin.load_tokenizer("builtin:smollm2-135m"))
    server = ProxyServer(
        RLService(
            generate=lambda prompts, params, seed: client.generate(prompts, params, seed=seed),
            renderer=renderer,
            model_name="smollm2",
        )
    )
    server.start()
    try:
        session = server.service.store.create(seed=1)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2+3?"}]
        usage = []
        with OpenAI(base_url=server.url + "/v1", api_key=session.api_key, max_retries=0) as sdk:
            for follow_up in ("And 4+4?", None):
                resp = sdk.chat.completions.create(model="smollm2", messages=messages, max_tokens=16)
                usage.append(resp.usage)
                messages.append(resp.choices[0].message.model_dump(exclude_none=True))
                if follow_up:
                    messages.append({"role": "user", "content": follow_up})
        records = server.service.store.samples(session.id)
        fresh = server.stats.snapshot()["fresh_renders"]
    finally:
        server.close()
        client.close()
    assert len(records) == 2
    first, second = records
    assert second.input_ids[: len(first.input_ids)] == first.input_ids
    for rec, u in zip(records, usage, strict=True):
        k = sum(rec.loss_mask)
        assert k == u.completion_tokens >= 1 and len(rec.input_ids) == u.total_tokens
        assert len(rec.logprobs) == len(rec.versions) == len(rec.input_ids)
        assert rec.versions == [-1] * (len(rec.input_ids) - k) + [VERSION] * k
        assert all(lp <= 0.0 for lp in rec.logprobs[-k:]) and any(lp < 0.0 for lp in rec.logprobs[-k:])
    assert fresh == {"edited": 0, "template": 0}
