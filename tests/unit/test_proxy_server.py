"""The proxy (treetrain.proxy.server) through the real openai SDK, sync and async, in-process on a
free loopback port, with the real ChatRenderer on the SmolLM2 tokenizer: multi-turn tool chats
whose samples chain token for token, auth, rewards, streaming, n, /v1/completions, /v1/models,
admission, batching, bounds and the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from openai import AsyncOpenAI, OpenAI
from proxy_helpers import (
    CALCULATOR,
    SCRIPTED_LOGPROB,
    SCRIPTED_VERSION,
    SMOL,
    Scripted,
    chained,
    check_sample,
    new_session,
    request,
    samples,
    serving,
)

from treetrain.config import ModelSettings
from treetrain.engines import builtin
from treetrain.engines.hf_model import build_model
from treetrain.proxy.chat import ChatRenderer
from treetrain.proxy.sampler import BatchingSampler
from treetrain.proxy.server import GREEDY_TEMPERATURE
from treetrain.proxy.sessions import ProxyLimits, Refused, SessionStore
from treetrain.rl.rollout import Generation, LocalRollout, SamplingParams

CALL_ADD = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
CALL_MUL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5*4"}}\n</tool_call>'
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(builtin.load_tokenizer(SMOL))


@pytest.fixture(scope="module")
def rollout() -> LocalRollout:
    """SmolLM2-135M on the CPU, loaded once for the module."""
    torch.manual_seed(0)
    return LocalRollout(build_model(ModelSettings(path=SMOL)), torch.device("cpu"))


@pytest.fixture
def local(rollout: LocalRollout) -> Any:
    """The real model as a Generate; the KV cache of an earlier test is dropped."""
    rollout.forget()
    return lambda prompts, params, seed: rollout.generate(prompts, params, seed=seed)


@pytest.fixture
def sync_client() -> Iterator[Any]:
    """A factory of closed-afterwards SDK clients that never retry (a retry would hide the status)."""
    made: list[OpenAI] = []

    def make(url: str, key: str) -> OpenAI:
        made.append(OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _three_turns(client: OpenAI, *, max_tokens: int | None = None) -> list[Any]:
    """user asks -> reply (+ tool result if it called a tool, else a new user message), three times;
    the assistant message goes back exactly as the SDK returned it."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2+3? Use the calculator."}]
    responses = []
    for _ in range(3):
        extra = {} if max_tokens is None else {"max_tokens": max_tokens}
        resp = client.chat.completions.create(model="any-name", messages=messages, tools=[CALCULATOR], **extra)
        responses.append(resp)
        message = resp.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Now multiply it by 4."})
    return responses


def _check_chain(records: list[dict], responses: list[Any]) -> None:
    assert len(records) == len(responses) == 3
    for rec, resp in zip(records, responses, strict=True):
        check_sample(rec)
        assert rec["completion_id"] == resp.id
        assert sum(rec["loss_mask"]) == resp.usage.completion_tokens
        assert len(rec["input_ids"]) == resp.usage.total_tokens
        assert rec["reward"] is None
    assert chained(records), [len(r["input_ids"]) for r in records]


def test_acceptance_three_turn_tool_chat_scripted(renderer: ChatRenderer, sync_client: Any) -> None:
    """A deterministic tool call: the Generate is SCRIPTED (tokens of a real <tool_call> reply),
    since the 135M model does not call tools on demand. Everything else is the real stack."""
    script = Scripted(renderer, [CALL_ADD, "The answer is 5.", CALL_MUL])
    with serving(script, renderer) as server:
        sid, key = new_session(server)
        responses = _three_turns(sync_client(server.url, key))
        records = samples(server, sid, key)
        snap = server.stats.snapshot()
    first, second, third = (r.choices[0] for r in responses)
    assert first.finish_reason == "tool_calls" and third.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "calculator"
    assert call.function.arguments == '{"expression": "2+3"}'
    assert second.message.content == "The answer is 5." and not second.message.tool_calls
    assert responses[0].model == "any-name"
    _check_chain(records, responses)
    # What reached the model: call k's prompt is sample k's prompt, and the tool's result is in call 2's.
    for rec, prompts in zip(records, script.calls, strict=True):
        k = sum(rec["loss_mask"])
        assert prompts == [rec["input_ids"][:-k]]
        assert rec["logprobs"][-k:] == [SCRIPTED_LOGPROB] * k and rec["versions"][-k:] == [SCRIPTED_VERSION] * k
    assert "<|im_start|>tool\n5<|im_end|>" in renderer.tokenizer.decode(script.calls[1][0])
    assert snap["fresh_renders"] == {"edited": 0, "template": 0}
    assert snap["requests"]["200"] == 5 and snap["completion_tokens"] == sum(
        r.usage.completion_tokens for r in responses
    )


@pytest.mark.slow
def test_acceptance_three_turn_tool_chat_real_model(renderer: ChatRenderer, local: Any, sync_client: Any) -> None:
    """The same chat fully with the real model: whatever it says, the samples chain."""
    with serving(local, renderer) as server:
        sid, key = new_session(server, seed=3)
        responses = _three_turns(sync_client(server.url, key), max_tokens=8)
        records = samples(server, sid, key)
        assert server.stats.snapshot()["fresh_renders"] == {"edited": 0, "template": 0}
    _check_chain(records, responses)
    assert all(v == 0 for r in records for v, m in zip(r["versions"], r["loss_mask"], strict=True) if m)
    assert all(lp < 0 for r in records for lp, m in zip(r["logprobs"], r["loss_mask"], strict=True) if m)


def test_auth_not_found_and_ended_sessions(renderer: ChatRenderer, sync_client: Any) -> None:
    with serving(Scripted(renderer, ["hi"]), renderer) as server:
        sid, key = new_session(server)
        other_sid, _ = new_session(server)
        msgs = [{"role": "user", "content": "hello"}]
        status, _, body = request(server.url, "POST", "/v1/chat/completions", {"messages": msgs})
        assert status == 401 and "POST /rl/sessions" in body["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            sync_client(server.url, "sk-sess-wrong").chat.completions.create(model="m", messages=msgs)
        with pytest.raises(openai.AuthenticationError):
            sync_client(server.url, "sk-sess-wrong").models.list()
        client = sync_client(server.url, key)
        rl = OpenAI(base_url=server.url, api_key=key, max_retries=0)
        try:
            with pytest.raises(openai.NotFoundError):
                rl.get("/rl/sessions/sess-nope/samples", cast_to=object)
            with pytest.raises(openai.NotFoundError):  # another session's id with this key: not yours
                rl.get(f"/rl/sessions/{other_sid}/samples", cast_to=object)
            assert client.chat.completions.create(model="m", messages=msgs).choices[0].message.content == "hi"
            assert rl.post(f"/rl/sessions/{sid}/end", cast_to=object) == {"id": sid, "ended": True}
            with pytest.raises(openai.ConflictError, match="has ended"):
                client.chat.completions.create(model="m", messages=msgs)
            assert len(rl.get(f"/rl/sessions/{sid}/samples", cast_to=object)["samples"]) == 1  # kept after the end
        finally:
            rl.close()
        codes = server.stats.snapshot()["requests"]
        assert codes["401"] == 3 and codes["404"] == 2 and codes["409"] == 1


def test_rewards_per_session_and_per_completion(renderer: ChatRenderer, sync_client: Any) -> None:
    with serving(Scripted(renderer, ["one", "two"]), renderer) as server:
        sid, key = new_session(server)
        client = sync_client(server.url, key)
        a = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])
        url = f"/rl/sessions/{sid}/reward"
        assert request(server.url, "POST", url, {"reward": 0.5, "completion_id": a.id}, key=key)[0] == 200
        assert request(server.url, "POST", url, {"reward": 1}, key=key)[0] == 200
        status, _, body = request(server.url, "POST", url, {"reward": "high"}, key=key)
        assert status == 400 and "reward must be a finite number" in body["error"]["message"]
        assert request(server.url, "POST", url, {"reward": 1.0, "completion_id": "chatcmpl-x"}, key=key)[0] == 404
        assert [r["reward"] for r in samples(server, sid, key)] == [0.5, None]
        assert server.service.store.session_reward(sid) == 1.0
        assert [r.text for r in server.service.store.samples(sid)] == ["one", "two"]
        server.service.store.discard(sid)
        with pytest.raises(Refused) as err:
            server.service.store.samples(sid)
        assert err.value.status == 404


def test_streaming_gives_the_same_text(renderer: ChatRenderer, local: Any, sync_client: Any) -> None:
    """Greedy (temperature 0) with the real model: streamed and plain replies agree, with usage."""
    with serving(local, renderer) as server:
        _, key = new_session(server)
        client = sync_client(server.url, key)
        msgs = [{"role": "user", "content": "Name a colour."}]
        plain = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=6)
        stream = client.chat.completions.create(
            model="m", messages=msgs, temperature=0, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        stream.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert GREEDY_TEMPERATURE < 1e-3


def test_n_choices_in_one_batch(renderer: ChatRenderer, sync_client: Any) -> None:
    script = Scripted(renderer, ["same"])
    with serving(script, renderer) as server:
        sid, key = new_session(server)
        resp = sync_client(server.url, key).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], n=2
        )
        records = samples(server, sid, key)
        bad = request(
            server.url,
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "n": 9},
            key=key,
        )
    assert [c.index for c in resp.choices] == [0, 1]
    assert [r["completion_id"] for r in records] == [f"{resp.id}-0", f"{resp.id}-1"]
    assert len(script.calls) == 1 and len(script.calls[0]) == 2  # one generate call for both
    assert resp.usage.completion_tokens == sum(sum(r["loss_mask"]) for r in records)
    assert bad[0] == 400 and bad[2]["error"]["param"] == "n"


def test_text_completions_models_and_stop_strings(renderer: ChatRenderer, sync_client: Any) -> None:
    script = Scripted(renderer, ["Hello world. And more."])
    with serving(script, renderer) as server:
        sid, key = new_session(server)
        client = sync_client(server.url, key)
        full = client.completions.create(model="m", prompt="Say hello:")
        cut = client.completions.create(model="m", prompt="Say hello:", stop=["."], max_tokens=400)
        ids = client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=2)
        models = client.models.list()
        records = samples(server, sid, key)
    assert full.object == "text_completion" and full.choices[0].text == "Hello world. And more."
    assert cut.choices[0].text == "Hello world" and cut.choices[0].finish_reason == "stop"
    # The sample keeps the sampled tokens up to the one that completes the stop string.
    kept = records[1]["input_ids"][-sum(records[1]["loss_mask"]) :]
    assert renderer.tokenizer.decode(kept).endswith(".") and not renderer.tokenizer.decode(kept[:-1]).endswith(".")
    assert records[0]["input_ids"][: full.usage.prompt_tokens] == renderer.render_text_prompt("Say hello:")
    assert [m.id for m in models.data] == [SMOL]
    assert (
        script.calls[2] == [[1, 2, 3]] and ids.usage.completion_tokens == 2 and ids.choices[0].finish_reason == "length"
    )


def test_admission_hook_and_session_bound(renderer: ChatRenderer) -> None:
    verdict: list[float | None] = [2.5]
    limits = ProxyLimits(max_sessions=2)
    with serving(Scripted(renderer, ["x"]), renderer, admit=lambda: verdict[0], limits=limits) as server:
        status, headers, body = request(server.url, "POST", "/rl/sessions", {})
        assert status == 429 and headers["retry-after"] == "3" and "Retry-After" in body["error"]["message"]
        verdict[0] = None
        sid, key = new_session(server)
        new_session(server)
        status, headers, body = request(server.url, "POST", "/rl/sessions", {})
        assert status == 429 and "max_sessions" in body["error"]["message"] and "retry-after" in headers
        assert request(server.url, "POST", f"/rl/sessions/{sid}/end", key=key)[0] == 200
        new_session(server)  # an ended session frees its place
        assert server.stats.snapshot()["sessions_open"] == 2


def test_async_clients_are_batched_and_a_failing_batch_fails_alone(renderer: ChatRenderer) -> None:
    """Four concurrent async calls while the worker is busy: they queue and go as ONE generate call.
    Then a generate that raises: 500 with its message for that call, and the next one is served."""
    release = threading.Event()
    sizes: list[int] = []
    fail = [False]
    script = Scripted(renderer, ["ok"])

    def generate(prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        sizes.append(len(prompts))
        if len(sizes) == 1:
            release.wait(DEADLINE_S)
        if fail[0]:
            raise RuntimeError("the GPU caught fire")
        return script(prompts, params, seed)

    with serving(generate, renderer) as server:
        keys = [new_session(server)[1] for _ in range(5)]

        async def one(key: str, text: str) -> str:
            async with AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
                resp = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
                return str(resp.choices[0].message.content)

        async def run() -> list[str]:
            first = asyncio.ensure_future(one(keys[0], "first"))
            deadline = time.monotonic() + DEADLINE_S
            while not sizes and time.monotonic() < deadline:  # the worker holds the first call
                await asyncio.sleep(0.01)
            rest = [asyncio.ensure_future(one(k, f"q{i}")) for i, k in enumerate(keys[1:])]
            while len(server.service.sampler._queue) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            release.set()
            return list(await asyncio.gather(first, *rest))

        assert asyncio.run(run()) == ["ok"] * 5
        assert sizes == [1, 4]
        fail[0] = True
        client = OpenAI(base_url=server.url + "/v1", api_key=keys[0], max_retries=0)
        try:
            with pytest.raises(openai.InternalServerError, match="the GPU caught fire"):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "boom"}])
            fail[0] = False
            assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
        finally:
            client.close()


def test_session_token_budget(renderer: ChatRenderer, sync_client: Any) -> None:
    script = Scripted(renderer, ["a fairly long reply of several tokens"])
    with serving(script, renderer, limits=ProxyLimits(max_session_tokens=120)) as server:
        sid, key = new_session(server)
        client = sync_client(server.url, key)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.APIStatusError) as err:
            for _ in range(10):
                resp = client.chat.completions.create(model="m", messages=msgs)
                msgs += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        assert err.value.status_code == 413 and "tokens" in err.value.message
        assert sum(len(r["input_ids"]) for r in samples(server, sid, key)) <= 120
        big = [{"role": "user", "content": "word " * 200}]
        with pytest.raises(openai.APIStatusError, match="session budget") as err:
            sync_client(server.url, new_session(server)[1]).chat.completions.create(model="m", messages=big)
        assert err.value.status_code == 413


def test_store_idle_timeout_and_bounded_ended_sessions() -> None:
    now = [0.0]
    store = SessionStore(ProxyLimits(max_sessions=3, idle_timeout_s=10.0), clock=lambda: now[0])
    a = store.create(seed=1)
    now[0] = 5.0
    b = store.create()
    store.authenticate(a.api_key)  # a used at t=5: both idle from 5
    now[0] = 14.0
    assert store.open_count() == 2
    now[0] = 15.5
    assert store.stats.snapshot()["sessions_open"] == 0  # no request came: the snapshot ends the idle ones
    assert store.get(a.id).ended and store.get(b.id).ended
    for _ in range(40):
        store.end(store.create().id)
    assert len(store) == 4 * 3  # the oldest ended ones were evicted
    with pytest.raises(Refused) as err:
        store.authenticate(a.api_key)
    assert err.value.status == 401


def test_sampler_seeds_split_batches() -> None:
    """Requests with their own seeds batch only with equal seeds; the others share one batch."""
    calls: list[tuple[int, int]] = []
    hold = threading.Event()

    def generate(prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        hold.wait(DEADLINE_S)
        calls.append((len(prompts), seed))
        return [Generation(tokens=[1], logprobs=[0.0]) for _ in prompts]

    sampler = BatchingSampler(generate, window_s=0.0)
    try:
        params = SamplingParams(max_new_tokens=4)
        blocker = sampler.submit([[0]], params, 99, explicit_seed=True)
        deadline = time.monotonic() + DEADLINE_S
        while sampler._queue and time.monotonic() < deadline:
            time.sleep(0.005)  # the worker took the blocker
        futures = [
            sampler.submit([[1]], params, 5, explicit_seed=True),
            sampler.submit([[2]], params, 11),
            sampler.submit([[3], [3]], params, 12),
            sampler.submit([[4]], params, 5, explicit_seed=True),
            sampler.submit([[5]], SamplingParams(max_new_tokens=8), 13),
        ]
        hold.set()
        assert blocker.result(DEADLINE_S)
        assert [len(f.result(DEADLINE_S)) for f in futures] == [1, 1, 2, 1, 1]
    finally:
        sampler.close()
    assert sorted(calls) == sorted([(1, 99), (2, 5), (3, 11), (1, 13)])


@pytest.mark.slow
def test_cli_serves_until_sigterm(tmp_path: Path) -> None:
    """ACCEPTANCE against the ``treetrain proxy`` process itself: it loads the model and prints its
    URL; the three-turn tool chat through the openai SDK chains token for token, each loss mask
    counts usage.completion_tokens, calls without a valid key get 401; SIGTERM exits 0."""
    proc, url, watchdog = _serve_cli(["--max-tokens", "6"], tmp_path)
    try:
        status, _, body = request(url, "POST", "/rl/sessions", {})
        assert status == 200
        sid, key = body["id"], body["api_key"]
        with OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300) as client:
            responses = _three_turns(client)
        assert all(1 <= r.usage.completion_tokens <= 6 for r in responses)
        _check_chain(samples_of(url, sid, key), responses)
        msgs = [{"role": "user", "content": "hi"}]
        assert request(url, "POST", "/v1/chat/completions", {"messages": msgs})[0] == 401
        assert request(url, "POST", "/v1/chat/completions", {"messages": msgs}, key="sk-sess-wrong")[0] == 401
        assert request(url, "GET", f"/rl/sessions/{sid}/samples")[0] == 401
        proc.terminate()
        assert proc.wait(DEADLINE_S) == 0
        assert "model: loaded on cpu" in (proc.stderr.read() if proc.stderr else "")
    finally:
        _reap(proc, watchdog)


def _reap(proc: subprocess.Popen[str], watchdog: threading.Timer) -> None:
    """The CLI process gone (killed if it still runs) and its pipes closed."""
    watchdog.cancel()
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _serve_cli(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen[str], str, threading.Timer]:
    """``treetrain proxy ARGS`` started; (the process, its base URL from the line it prints, a
    watchdog that kills it after the deadline: a server that never prints must not hang the run)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "treetrain.cli", "proxy", "--model", SMOL, "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    watchdog = threading.Timer(3 * DEADLINE_S, proc.kill)
    watchdog.start()
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if not line.startswith(f"treetrain proxy: serving {SMOL} at http://127.0.0.1:"):
        watchdog.cancel()
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"treetrain proxy printed {line!r}; stderr: {err[-2000:]}")
    return proc, line.split(" at ")[1].strip().removesuffix("/v1"), watchdog


def test_cli_with_a_rollout_server(tmp_path: Path) -> None:
    """``--rollout URL``: sampling on a server (bench/rollout_standin.py, SGLang's dialect), no model loaded.
    The process serves its counters at /metrics and writes one line per request on stderr."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from rollout_standin import RolloutStandin

    with RolloutStandin(token_delay_s=0.001, vocab=64, first_token=4, seed=3) as standin:
        proc, url, watchdog = _serve_cli(["--rollout", standin.url, "--max-tokens", "5"], tmp_path)
        try:
            status, _, body = request(url, "POST", "/rl/sessions", {})
            assert status == 200
            with OpenAI(base_url=url + "/v1", api_key=body["api_key"], max_retries=0) as client:
                resp = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            (rec,) = samples_of(url, body["id"], body["api_key"])
            status, _, scraped = request(url, "GET", "/metrics")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(DEADLINE_S) == 0
            log = proc.stderr.read() if proc.stderr else ""
        finally:
            _reap(proc, watchdog)
        assert standin.requests >= 1
    assert resp.usage.completion_tokens == 5 == sum(rec["loss_mask"])
    assert rec["logprobs"][-5:] == [pytest.approx(standin.logprob)] * 5 and rec["versions"][-5:] == [0] * 5
    assert status == 200 and 'treetrain_proxy_requests_total{code="200"} 3.0' in scraped
    assert "treetrain_proxy_completion_tokens_total 5.0" in scraped and "treetrain_proxy_sessions_open 1.0" in scraped
    requests = [line for line in log.splitlines() if line.startswith("treetrain proxy: ") and " session=" in line]
    assert [line.split(" session=")[0] for line in requests] == [
        "treetrain proxy: POST /rl/sessions 200",
        "treetrain proxy: POST /v1/chat/completions 200",
        f"treetrain proxy: GET /rl/sessions/{body['id']}/samples 200",
        "treetrain proxy: GET /metrics 200",
    ]
    assert f"session={body['id'][:13]} prompt_tokens={resp.usage.prompt_tokens} completion_tokens=5 " in requests[1]


def samples_of(url: str, sid: str, key: str) -> list[dict[str, Any]]:
    status, _, got = request(url, "GET", f"/rl/sessions/{sid}/samples", key=key)
    assert status == 200, got
    return list(got["samples"])


def test_cli_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from treetrain.cli import main

    assert main(["proxy", "--model", SMOL, "--port", "70000"]) == 2
    assert "--port must be 0..65535" in capsys.readouterr().err
    assert main(["proxy", "--model", "builtin:nope"]) == 2
    assert "builtin:" in capsys.readouterr().err


def test_sampler_hold_waits_for_the_running_batch_and_keeps_new_ones_out() -> None:
    """The trainer's optimizer step on the model local rollout samples from goes inside hold()."""
    running, go, release = threading.Event(), threading.Event(), threading.Event()
    held = threading.Event()
    log: list[str] = []

    def generate(prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        running.set()
        go.wait(DEADLINE_S)
        log.append(f"generate {prompts[0][0]}")
        return [Generation(tokens=[1], logprobs=[0.0]) for _ in prompts]

    def holder() -> None:
        with sampler.hold():
            log.append("held")
            held.set()
            release.wait(DEADLINE_S)
            log.append("released")

    sampler = BatchingSampler(generate, window_s=0.0)
    params = SamplingParams(max_new_tokens=1)
    t = threading.Thread(target=holder)
    try:
        first = sampler.submit([[1]], params, 0)
        assert running.wait(DEADLINE_S)
        t.start()
        deadline = time.monotonic() + DEADLINE_S
        while not sampler._holds and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not held.is_set()  # the hold waits for the batch under way
        go.set()
        assert first.result(DEADLINE_S) and held.wait(DEADLINE_S)
        second = sampler.submit([[2]], params, 0)
        assert not second.done()
        release.set()
        assert second.result(DEADLINE_S)
    finally:
        go.set()
        release.set()
        t.join(DEADLINE_S)
        sampler.close()
    assert log == ["generate 1", "held", "released", "generate 2"]
