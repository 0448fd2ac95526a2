"""The proxy's memory and fairness bounds: local sampling computes the last position's logits only
(every engine's sampling model), the sampler's batches are bounded in tokens, one client cannot
take every session place, unused sessions end early, and an agent whose history never stops
growing runs into its session's token budget with one line. Scripted Generate, or tiny models
built from a config on the CPU."""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

import pytest
import torch
from proxy_helpers import SMOL, Scripted, request, serving

from treetrain.config import ModelSettings
from treetrain.engines import builtin
from treetrain.engines.hf_model import build_model
from treetrain.proxy.chat import ChatRenderer
from treetrain.proxy.sampler import BatchingSampler
from treetrain.proxy.sessions import ProxyLimits, Refused, SessionStore
from treetrain.rl.rollout import Generation, LocalRollout, SamplingParams
from treetrain.trainer.agents import Job, run_agents

DEADLINE_S = 60.0
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(builtin.load_tokenizer(SMOL))


def _logit_widths(model: torch.nn.Module) -> list[int]:
    """A forward hook's record: the positions each forward computed logits for."""
    widths: list[int] = []
    model.register_forward_hook(lambda _m, _args, out: widths.append(int(out.logits.shape[1])))
    return widths


def test_local_sampling_computes_only_the_last_positions_logits() -> None:
    """A 300-token prompt batch and its next turn (the kept KV cache): every forward returns one
    position's logits (before: one per prompt token, 300 x the vocabulary), and the samples and
    log-probs are those of a rollout that computes them all."""
    model = build_model(ModelSettings(path="builtin:tiny-llama", seed=5))
    widths = _logit_widths(model)
    params = SamplingParams(max_new_tokens=5)
    prompts = [[1, *range(10, 310)], [1, *range(40, 140)]]
    rollout = LocalRollout(model, torch.device("cpu"))
    gens = rollout.generate(prompts, params, seed=3)
    nxt = [p + g.tokens + [5, 6, 7] for p, g in zip(prompts, gens, strict=True)]
    again = rollout.generate(nxt, params, seed=4)
    assert widths and set(widths) == {1}, widths
    every = LocalRollout(model, torch.device("cpu"))
    every._keep_last = {}  # the old way: logits at every position
    widths.clear()
    reference = every.generate(prompts, params, seed=3)
    assert max(widths) == 301  # the hook sees the difference
    reference_again = every.generate(nxt, params, seed=4)
    for got, want in zip([*gens, *again], [*reference, *reference_again], strict=True):
        assert got.tokens == want.tokens
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
TINY |= {"num_key_value_heads": 1, "vocab_size": 128, "head_dim": 16}
MOE = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_every_engines_sampling_model_keeps_one_position(family: str) -> None:
    """Archon and Megatron sample from a transformers model built from the config
    (engine.sampling_model(); FSDP's is one already): the families they convert take the keyword."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **TINY, **(MOE if family == "qwen3_moe" else {}))
    model = AutoModelForCausalLM.from_config(config)
    widths = _logit_widths(model)
    rollout = LocalRollout(model, torch.device("cpu"))
    assert rollout._keep_last == {"logits_to_keep": 1}
    rollout.generate([[1, *range(2, 60)]], SamplingParams(max_new_tokens=2), seed=0)
    assert widths == [1, 1]


def test_sampler_batches_are_bounded_in_padded_tokens() -> None:
    """Requests queue behind a running batch. With max_batch_tokens 2,000 (counted as prompts x the
    longest, what local rollout's padded KV cache holds), a request that would pass it waits for
    the next batch and later ones that fit go first; one that passes it alone runs alone."""
    hold = threading.Event()
    calls: list[list[int]] = []

    def generate(prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        hold.wait(DEADLINE_S)
        calls.append([len(p) for p in prompts])
        return [Generation(tokens=[1], logprobs=[0.0]) for _ in prompts]

    sampler = BatchingSampler(generate, window_s=0.0, max_batch_tokens=2000)
    try:
        params = SamplingParams(max_new_tokens=4)
        blocker = sampler.submit([[0]], params, 1)
        deadline = time.monotonic() + DEADLINE_S
        while sampler._queue and time.monotonic() < deadline:
            time.sleep(0.005)  # the worker took the blocker
        shapes = [(10, 100), (1, 1500), (5, 100), (1, 3000), (4, 100)]  # (prompts, tokens each)
        futures = [sampler.submit([[7] * n] * k, params, 1) for k, n in shapes]
        hold.set()
        assert len(blocker.result(DEADLINE_S)) == 1
        assert [len(f.result(DEADLINE_S)) for f in futures] == [k for k, _ in shapes]
    finally:
        sampler.close()
    assert calls[0] == [1]
    assert calls[1:] == [[100] * 19, [1500], [3000]]  # 19 x 100; 1 x 1500; the 3,000 alone
    assert all(len(c) * max(c) <= 2000 for c in calls[1:-1])


def test_one_store_bounds_sessions_per_client_and_ends_unused_ones_early() -> None:
    now = [0.0]
    limits = ProxyLimits(max_sessions=10, max_sessions_per_client=3, unused_timeout_s=5.0, idle_timeout_s=600.0)
    store = SessionStore(limits, clock=lambda: now[0])
    mine = [store.create(client="10.0.0.1") for _ in range(3)]
    with pytest.raises(Refused) as err:
        store.create(client="10.0.0.1")
    assert err.value.status == 429 and err.value.retry_after_s == 1.0
    assert err.value.message == (
        "10.0.0.1 has 3 sessions open, the limit per client (max_sessions_per_client); "
        "end one (POST /rl/sessions/{id}/end) or retry later"
    )
    other = store.create(client="10.0.0.2")  # another client, and the trainer's own, still get theirs
    trainers = [store.create() for _ in range(4)]
    store.end(mine[0].id)
    mine.append(store.create(client="10.0.0.1"))  # an ended session frees its client's place
    store.discard(mine[1].id)
    mine.append(store.create(client="10.0.0.1"))  # so does a discarded one
    now[0] = 2.0
    store.begin(mine[2], prompt_len=3, n=1, max_new_tokens=4)  # a completion: no longer unused
    store.authenticate(other.api_key)  # a key check is no completion: it stays unused
    now[0] = 5.5
    assert store.open_count() == len(trainers) + 1
    assert not store.get(mine[2].id).ended and all(not store.get(t.id).ended for t in trainers)
    assert store.get(other.id).ended and store.get(mine[-1].id).ended
    assert [store.create(client="10.0.0.1") for _ in range(2)]  # the client's places came back


def _open_from(server: Any, source: str) -> tuple[int, dict[str, Any]]:
    """POST /rl/sessions from the loopback address ``source`` (Linux routes all of 127/8 locally)."""
    port = int(server.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S, source_address=(source, 0))
    try:
        conn.request("POST", "/rl/sessions", body=b"{}", headers={"Content-Type": "application/json"})
        res = conn.getresponse()
        return res.status, json.loads(res.read())
    finally:
        conn.close()


def test_a_flood_from_one_address_leaves_places_for_others(renderer: ChatRenderer) -> None:
    """ACCEPTANCE: one address opens sessions as fast as it can (it took all 1,023 before, 429 for
    everyone until the idle timeout); it gets its bound, then 429 naming it, and another address
    still opens and completes. Unused, its sessions end after unused_timeout_s."""
    limits = ProxyLimits(max_sessions=64, max_sessions_per_client=16, unused_timeout_s=1.0)
    with serving(Scripted(renderer, ["fine"]), renderer, limits=limits) as server:
        flood = [_open_from(server, "127.0.0.2") for _ in range(limits.max_sessions)]
        assert [s for s, _ in flood] == [200] * 16 + [429] * (limits.max_sessions - 16)
        assert "max_sessions_per_client" in flood[-1][1]["error"]["message"]
        status, body = _open_from(server, "127.0.0.3")
        assert status == 200
        got = request(server.url, "POST", "/v1/chat/completions", {"messages": USER}, key=body["api_key"])
        assert got[0] == 200
        deadline = time.monotonic() + DEADLINE_S
        while server.service.store.open_count() > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.service.store.open_count() == 1  # the flood's 16 ended unused; the one that completed stays
        assert _open_from(server, "127.0.0.2")[0] == 200


def test_an_agent_whose_history_never_ends_meets_its_token_budget(renderer: ChatRenderer) -> None:
    """An agent that calls on with an ever-longer history in one session (2,000 new tokens a turn
    at the 32k default; here ~120 of 600): the budget refuses the call that would pass it with a
    413 that names trainer.maxEpisodeTokens, and the run ends with one line, left out of its group;
    the session holds no more than its budget."""
    turn = "more words " * 40
    kept: list[int] = []

    async def endless(client: Any, row: dict[str, Any]) -> float:
        messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
        for _ in range(1000):
            reply = await client.chat.completions.create(model="m", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_unset=True), {"role": "user", "content": turn}]
            kept.append(reply.usage.total_tokens)
        return 1.0

    lines: list[str] = []
    limits = ProxyLimits(max_session_tokens=600, max_tokens=32)
    with serving(Scripted(renderer, ["and on and on"]), renderer, limits=limits) as server:
        [run] = run_agents(
            endless,
            [Job(row={"prompt": "go"}, seed=1, where="step 1, group 0, run 0")],
            server=server,
            timeout_s=DEADLINE_S,
            reward_runner=None,
            log=lines.append,
        )
        assert server.stats.snapshot()["requests"]["413"] == 1
    assert len(kept) >= 2 and sum(kept) <= limits.max_session_tokens
    assert run.error is not None and not run.records
    [line] = lines
    assert line.startswith("agent: step 1, group 0, run 0: raised APIStatusError: Error code: 413")
    assert "trainer.maxEpisodeTokens" in line and line.endswith("that run is left out of its group")
    assert "\n" not in line


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--max-sessions-per-client", "0"], "--max-sessions-per-client must be >= 1, got 0"),
        (["--max-session-tokens", "0"], "--max-session-tokens must be >= 1, got 0"),
        (
            ["--max-tokens", "512", "--max-session-tokens", "512"],
            "--max-tokens 512 leaves no room for a prompt in --max-session-tokens 512: lower it or raise "
            "--max-session-tokens",
        ),
    ],
)
def test_cli_bound_flags_are_checked(capsys: pytest.CaptureFixture[str], flags: list[str], line: str) -> None:
    from treetrain.cli import main

    assert main(["proxy", "--model", SMOL, *flags]) == 2
    assert capsys.readouterr().err == f"treetrain proxy: error: {line}\n"
