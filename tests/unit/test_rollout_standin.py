"""bench/rollout_standin.py through our real SGLang client: generation, pauses, weight loads.

Waits are on the stand-in's own state (``wait_for``), never fixed sleeps."""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from rollout_standin import RolloutStandin

from treetrain.rl.rollout import RolloutError, SamplingParams, SGLangRollout, http_json, probe_kind

WAIT = 60.0  # generous: a shared 2-core machine


@pytest.fixture
def standin() -> Iterator[RolloutStandin]:
    with RolloutStandin(token_delay_s=0.002, vocab=64, first_token=4, seed=3) as server:
        yield server


def _body(n: int, seed: int = 0, prompt: list[int] | None = None) -> dict[str, Any]:
    return {
        "input_ids": prompt or [1, 2, 3],
        "sampling_params": {"max_new_tokens": n, "sampling_seed": seed},
        "return_logprob": True,
    }


class _Request(threading.Thread):
    """One /generate in a thread; ``out`` is (status, body) once it returned."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.out: tuple[int, Any] | None = None
        self.start()

    def run(self) -> None:
        self.out = http_json("POST", self.url + "/generate", self.body, WAIT)


def test_the_client_generates_tokens_with_logprobs(standin: RolloutStandin) -> None:
    assert probe_kind(standin.url) == "sglang"
    client = SGLangRollout(endpoints=[standin.url])
    client.wait_ready(WAIT)
    prompts = [[1, 2, 3], [1, 2, 3, 4], [5]]
    gens = client.generate(prompts, SamplingParams(max_new_tokens=5), seed=7)
    assert [len(g.tokens) for g in gens] == [5, 5, 5]
    assert all(4 <= t < 64 for g in gens for t in g.tokens)
    assert all(lp == pytest.approx(-math.log(60)) for g in gens for lp in g.logprobs)
    assert {g.finish_reason for g in gens} == {"length"}
    again = client.generate(prompts, SamplingParams(max_new_tokens=5), seed=7)
    assert [g.tokens for g in again] == [g.tokens for g in gens]  # seeded: the same request, the same tokens
    assert standin.requests == 6 and standin.tokens == 30


def test_stop_tokens_end_a_generation(standin: RolloutStandin) -> None:
    client = SGLangRollout(endpoints=[standin.url])
    params = SamplingParams(max_new_tokens=400, stop_token_ids=tuple(range(4, 34)))  # half the vocabulary
    (gen,) = client.generate([[9]], params, seed=1)
    assert gen.finish_reason == "stop" and gen.tokens[-1] < 34 and len(gen.tokens) < 400


def test_requests_generate_at_once_without_cpu(standin: RolloutStandin) -> None:
    """Many requests share the wall clock: all of them are in flight together."""
    reqs = [_Request(standin.url, _body(20_000, seed=i)) for i in range(6)]
    assert standin.wait_for(lambda s: s.active == 6, WAIT)
    standin.post("/pause_generation", {"mode": "abort"})
    for r in reqs:
        r.join(WAIT)
    assert all(r.out is not None and r.out[1]["meta_info"]["finish_reason"]["type"] == "abort" for r in reqs)
    assert standin.busy_seconds() > 0 and standin.active == 0


def test_pause_abort_returns_the_partial_reply_and_holds_new_requests(standin: RolloutStandin) -> None:
    long = _Request(standin.url, _body(20_000))
    assert standin.wait_for(lambda s: s.tokens >= 3, WAIT)
    assert http_json("POST", standin.url + "/pause_generation", {"mode": "abort"}, WAIT)[0] == 200
    long.join(WAIT)
    assert long.out is not None
    status, out = long.out
    meta = out["meta_info"]
    assert status == 200 and meta["finish_reason"]["type"] == "abort"
    assert 3 <= len(meta["output_token_logprobs"]) < 20_000
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    waiting = _Request(standin.url, _body(4))  # sent while paused: held until continue
    assert standin.wait_for(lambda s: s.requests == 2, WAIT)
    waiting.join(0.2)
    assert waiting.is_alive() and standin.tokens == len(out["output_ids"])
    assert http_json("POST", standin.url + "/continue_generation", {}, WAIT)[0] == 200
    waiting.join(WAIT)
    assert waiting.out is not None and len(waiting.out[1]["output_ids"]) == 4
    assert waiting.out[1]["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_in_place_holds_in_flight_requests_then_finishes_them(standin: RolloutStandin) -> None:
    reqs = [_Request(standin.url, _body(100)) for _ in range(2)]
    assert standin.wait_for(lambda s: s.tokens >= 2, WAIT)
    standin.post("/pause_generation", {"mode": "in_place"})
    held = standin.tokens
    reqs[0].join(0.2)
    assert reqs[0].is_alive() and standin.tokens == held  # not one token while paused
    standin.post("/continue_generation", {})
    for req in reqs:
        req.join(WAIT)
        assert req.out is not None and len(req.out[1]["output_ids"]) == 100
        assert req.out[1]["meta_info"]["finish_reason"]["type"] == "length"
    assert standin.active == 0 and standin.tokens == 200  # each request left the running batch


def test_weight_loads_record_the_version_and_abort_in_flight_requests(standin: RolloutStandin, tmp_path: Path) -> None:
    client = SGLangRollout(endpoints=[standin.url], retries=0)
    assert client.stale_servers(1) == [standin.url]  # "default": the initial weights
    long = _Request(standin.url, _body(20_000))
    assert standin.wait_for(lambda s: s.tokens >= 1, WAIT)
    client.update_weights(str(tmp_path), 1)  # pause (abort), load, continue
    long.join(WAIT)
    assert long.out is not None and long.out[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert standin.loads == [(str(tmp_path), "1")] and not standin.paused
    assert client.stale_servers(1) == []
    (gen,) = client.generate([[1]], SamplingParams(max_new_tokens=2), seed=0)
    assert len(gen.tokens) == 2
    with pytest.raises(RolloutError, match="no model at"):
        client.update_weights(str(tmp_path / "missing"), 2)
    assert standin.weight_version == "1" and not standin.paused  # resumed after the failed load


def test_requests_beyond_max_running_wait_their_turn() -> None:
    with RolloutStandin(token_delay_s=0.002, max_running=2) as server:
        reqs = []
        for i in range(3):  # one after the other: the third is the one that queues
            reqs.append(_Request(server.url, _body(20_000, seed=i)))
            assert server.wait_for(lambda s, n=i: s.requests == n + 1 and s.active == min(n + 1, 2), WAIT)
        made = server.tokens
        assert server.wait_for(lambda s: s.tokens >= made + 4, WAIT)  # both running ones have tokens
        server.post("/pause_generation", {"mode": "abort"})  # the queued one ends too, with no token
        for r in reqs:
            r.join(WAIT)
        outs = sorted(len(r.out[1]["output_ids"]) for r in reqs if r.out is not None)
        assert len(outs) == 3 and outs[0] == 0 and outs[1] > 0 and server.aborted == 3


def test_queued_requests_start_in_arrival_order() -> None:
    with RolloutStandin(token_delay_s=0.002, max_running=1) as server:
        first = _Request(server.url, _body(100))
        assert server.wait_for(lambda s: s.active == 1, WAIT)
        queued = []
        for i in range(4):
            queued.append(_Request(server.url, _body(2, seed=i)))
            assert server.wait_for(lambda s, n=i: s.requests == n + 2, WAIT)  # arrived before the next is sent
        for req in [first, *queued]:
            req.join(WAIT)
        # Judged by the server's own record: the clients' finishing times are 4 ms apart, and a
        # busy machine may wake their threads in another order (the test failed that way in CI).
        assert server.started == [1, 2, 3, 4, 5]  # each queued request was started in the order it came


def test_bad_requests_are_refused(standin: RolloutStandin) -> None:
    assert http_json("POST", standin.url + "/generate", {"sampling_params": {}}, WAIT)[0] == 400
    assert http_json("POST", standin.url + "/nowhere", {}, WAIT)[0] == 404
    with pytest.raises(ValueError, match="first_token"):
        RolloutStandin(vocab=4, first_token=4)


def test_a_stop_abandons_a_generate_call_waiting_on_the_server(standin: RolloutStandin) -> None:
    """SIGTERM during a synchronous rollout on servers: the call raises RolloutStopped at its
    next poll, and its requests (which would run ~40 s more) are left to the server."""
    from treetrain.rl.progress import RolloutStopped

    stop = threading.Event()
    client = SGLangRollout(endpoints=[standin.url])
    client.stop = stop.is_set
    raised: list[BaseException] = []

    def call() -> None:
        try:
            client.generate([[1, 2], [3]], SamplingParams(max_new_tokens=20_000), seed=0)
        except BaseException as err:
            raised.append(err)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    assert standin.wait_for(lambda s: s.active == 2, WAIT)
    stop.set()
    caller.join(WAIT)
    assert not caller.is_alive() and len(raised) == 1 and isinstance(raised[0], RolloutStopped)
    standin.post("/pause_generation", {"mode": "abort"})  # end the abandoned requests before the server closes
