"""SGLang and vLLM rollout clients against local HTTP stand-ins.

The stand-ins (helpers/rollout.py) are NOT SGLang or vLLM: small fakes on 127.0.0.1 that
answer with the shapes those servers document and record every call, so the tests can assert
the weight-sync sequence. Nothing here dials anything but loopback.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.rollout import PARAMS, FakeServer, fake_tokens

from treetrain.rl.rollout import (
    MixedRollout,
    RolloutError,
    SamplingParams,
    SGLangRollout,
    VLLMRollout,
    detect_kind,
    remote_client,
)


@pytest.fixture
def sglang() -> Iterator[FakeServer]:
    server = FakeServer("sglang")
    yield server
    server.close()


@pytest.fixture
def vllm() -> Iterator[FakeServer]:
    server = FakeServer("vllm")
    yield server
    server.close()


def test_sglang_generate_sends_token_ids_and_reads_logprobs(sglang: FakeServer) -> None:
    client = SGLangRollout(endpoints=[sglang.url + "/"])
    client.wait_ready(5)
    gens = client.generate([[1, 2, 3], [4, 5]], PARAMS, seed=7)
    assert [g.tokens for g in gens] == [fake_tokens([1, 2, 3], 3), fake_tokens([4, 5], 3)]
    assert gens[0].logprobs == [-0.5] * 3 and gens[0].finish_reason == "length"
    bodies = sorted((b for m, p, b in sglang.calls if p == "/generate"), key=lambda b: len(b["input_ids"]))
    assert bodies[1]["input_ids"] == [1, 2, 3]
    assert bodies[1]["return_logprob"] is True and bodies[1]["stream"] is False
    sp = bodies[1]["sampling_params"]
    assert (sp["max_new_tokens"], sp["temperature"], sp["top_p"], sp["stop_token_ids"]) == (3, 0.7, 0.9, [2])


def test_vllm_generate_uses_completions_with_token_ids(vllm: FakeServer) -> None:
    client = VLLMRollout(endpoints=[vllm.url], model="m")
    (gen,) = client.generate([[9, 9, 9, 9]], PARAMS, seed=1)
    assert gen.tokens == fake_tokens([9, 9, 9, 9], 3) and gen.logprobs == [-0.25] * 3
    (body,) = [b for m, p, b in vllm.calls if p == "/v1/completions"]
    assert body["prompt"] == [9, 9, 9, 9] and body["max_tokens"] == 3 and body["model"] == "m"
    assert body["logprobs"] == 0 and body["return_token_ids"] is True


def test_prompts_spread_over_every_server() -> None:
    servers = [FakeServer("sglang"), FakeServer("sglang")]
    try:
        client = SGLangRollout(endpoints=[s.url for s in servers])
        client.generate([[1], [2], [3], [4]], PARAMS, seed=0)
        assert [len(s.paths()) for s in servers] == [2, 2]
    finally:
        for s in servers:
            s.close()


def test_server_errors_are_retried_then_reported() -> None:
    flaky = FakeServer("sglang", fail_first=2)
    try:
        client = SGLangRollout(endpoints=[flaky.url], retries=2, retry_backoff_s=0.01)
        assert client.generate([[1, 2]], PARAMS, seed=0)[0].tokens == fake_tokens([1, 2], 3)
        assert flaky.paths().count("/generate") == 3
        flaky.fail_first = 5
        with pytest.raises(RolloutError, match="HTTP 503"):
            SGLangRollout(endpoints=[flaky.url], retries=1, retry_backoff_s=0.01).generate([[1]], PARAMS, seed=0)
    finally:
        flaky.close()


def test_client_errors_fail_at_once(vllm: FakeServer) -> None:
    client = SGLangRollout(endpoints=[vllm.url], retries=3, retry_backoff_s=0.01)  # wrong kind: 404
    with pytest.raises(RolloutError, match="HTTP 404"):
        client.generate([[1]], PARAMS, seed=0)
    assert vllm.paths().count("/generate") == 1


def test_unreachable_servers_time_out_with_their_names() -> None:
    dead = FakeServer("sglang")
    url = dead.url
    dead.close()  # nothing listens on that loopback port now
    with pytest.raises(RolloutError, match=url):
        SGLangRollout(endpoints=[url]).wait_ready(0.1)


def test_detect_kind(sglang: FakeServer, vllm: FakeServer) -> None:
    assert detect_kind([sglang.url]) == "sglang"
    assert detect_kind([vllm.url]) == "vllm"


def test_sglang_weight_sync_sequence(sglang: FakeServer, tmp_path: Path) -> None:
    SGLangRollout(endpoints=[sglang.url]).update_weights(str(tmp_path), 3)
    assert sglang.paths() == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    body = next(b for m, p, b in sglang.calls if p == "/update_weights_from_disk")
    assert body == {"model_path": str(tmp_path), "abort_all_requests": True, "weight_version": "3"}
    with pytest.raises(RolloutError, match="update_weights_from_disk"):
        SGLangRollout(endpoints=[sglang.url], retries=0).update_weights(str(tmp_path / "missing"), 4)
    assert sglang.paths()[-1] == "/continue_generation"  # generation resumes even after a failed load


def weights_dir(path: Path) -> Path:
    """A directory that passes the vLLM client's completeness check."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_vllm_weight_sync_sequence(vllm: FakeServer, tmp_path: Path) -> None:
    """With our worker extension (it answers loaded_weight_version) the directory is loaded by
    it, as a broadcast is, and the version recorded (restarts show)."""
    client = VLLMRollout(endpoints=[vllm.url])
    client.update_weights(str(weights_dir(tmp_path)), 1)
    assert vllm.paths() == ["/pause?mode=abort", "/collective_rpc", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    probe, load = [b for m, p, b in vllm.calls if p == "/collective_rpc"]
    assert probe == {"method": "loaded_weight_version", "kwargs": {}}
    assert load == {"method": "load_weights_from_disk", "kwargs": {"weights_path": str(tmp_path), "version": 1}}
    assert client.stale_servers(1) == []


def test_vllm_without_our_extension_reloads_with_its_own_method(tmp_path: Path) -> None:
    plain = FakeServer("vllm", extension=False)
    try:
        VLLMRollout(endpoints=[plain.url]).update_weights(str(weights_dir(tmp_path)), 1)
        assert plain.paths() == [
            "/pause?mode=abort",
            "/collective_rpc",
            "/collective_rpc",
            "/reset_prefix_cache",
            "/resume",
        ]
        reload = [b for m, p, b in plain.calls if p == "/collective_rpc"][-1]
        assert reload == {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
    finally:
        plain.close()


def test_vllm_never_asks_to_load_incomplete_weights(vllm: FakeServer, tmp_path: Path) -> None:
    """A path vLLM cannot load answers 500 and breaks the server: the client checks it first."""
    client = VLLMRollout(endpoints=[vllm.url])
    with pytest.raises(RolloutError, match=r"missing config\.json, \*\.safetensors"):
        client.update_weights(str(tmp_path / "missing"), 1)
    (weights_dir(tmp_path) / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-2.safetensors"}}')
    with pytest.raises(RolloutError, match=r"missing model-2\.safetensors"):
        client.update_weights(str(tmp_path), 1)
    assert vllm.calls == []


def test_stale_servers_are_those_reporting_another_version(sglang: FakeServer, vllm: FakeServer) -> None:
    """What a restarted server reports: SGLang /model_info's weight_version "default", our vLLM
    extension's loaded_weight_version None; servers that cannot say are never stale."""
    client = _mixed(sglang, vllm)
    assert client.stale_servers(1) == [sglang.url, vllm.url]
    sglang.weight_version, vllm.weight_version = "1", 1
    assert client.stale_servers(1) == []
    vllm.weight_version = None  # restarted
    assert client.stale_servers(1) == [vllm.url]
    old = FakeServer("vllm", pause_routes=False)
    try:
        assert VLLMRollout(endpoints=[old.url]).stale_servers(1) == [old.url]
        assert VLLMRollout(endpoints=["http://127.0.0.1:1"]).stale_servers(1) == []  # cannot say
    finally:
        old.close()


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_servers_without_pause_routes_still_reload(kind: str, tmp_path: Path) -> None:
    old = FakeServer(kind, pause_routes=False)
    try:
        client = SGLangRollout(endpoints=[old.url]) if kind == "sglang" else VLLMRollout(endpoints=[old.url])
        client.update_weights(str(weights_dir(tmp_path)), 1)
        # The pause was tried, no resume (vLLM: the version recorded and the prefix cache dropped).
        sglang = ["/pause_generation", "/update_weights_from_disk"]
        vllm = ["/pause?mode=abort", "/collective_rpc", "/collective_rpc", "/reset_prefix_cache"]
        assert old.paths() == (sglang if kind == "sglang" else vllm)
    finally:
        old.close()


def _mixed(sglang: FakeServer, vllm: FakeServer, **kwargs: Any) -> MixedRollout:
    client = remote_client([(sglang.url, "sglang"), (vllm.url + "/", "vllm")], **kwargs)
    assert isinstance(client, MixedRollout)
    return client


def test_mixed_servers_each_get_their_own_dialect(sglang: FakeServer, vllm: FakeServer) -> None:
    client = _mixed(sglang, vllm, model="m")
    assert client.kind == "sglang+vllm"
    prompts = [[1], [2, 2], [3, 3, 3], [4, 4, 4, 4]]
    gens = client.generate(prompts, PARAMS, seed=10)
    # In prompt order: even prompts came from SGLang (log-prob -0.5), odd ones from vLLM (-0.25).
    assert [g.tokens for g in gens] == [fake_tokens(p, 3) for p in prompts]
    assert [g.logprobs[0] for g in gens] == [-0.5, -0.25, -0.5, -0.25]
    assert sglang.paths() == ["/generate"] * 2 and vllm.paths() == ["/v1/completions"] * 2
    sg = sorted((b["input_ids"], b["sampling_params"]["sampling_seed"]) for m, p, b in sglang.calls)
    vl = sorted((b["prompt"], b["seed"], b["model"]) for m, p, b in vllm.calls)
    assert sg == [([1], 10), ([3, 3, 3], 12)]
    assert vl == [([2, 2], 11, "m"), ([4, 4, 4, 4], 13, "m")]
    # The round-robin carries over between calls: 1 + 1 more prompts reach both servers again.
    client.generate([[5]], PARAMS, seed=0)
    client.generate([[6]], PARAMS, seed=0)
    assert len(sglang.paths()) == 3 and len(vllm.paths()) == 3
    assert client.generate([], PARAMS, seed=0) == []


def test_auto_probes_each_server_on_its_own(sglang: FakeServer, vllm: FakeServer) -> None:
    client = remote_client([(vllm.url, "auto"), (sglang.url, "auto")])
    assert isinstance(client, MixedRollout) and client.kind == "sglang+vllm"
    assert {c.kind: c.endpoints for c in client.clients} == {"sglang": [sglang.url], "vllm": [vllm.url]}
    assert sglang.paths("GET") == ["/model_info"]
    assert vllm.paths("GET") == ["/model_info", "/get_model_info", "/v1/models"]


def test_one_kind_gives_the_plain_client(sglang: FakeServer, vllm: FakeServer) -> None:
    other = FakeServer("sglang")
    try:
        both = remote_client([(sglang.url, "auto"), (other.url, "sglang"), (sglang.url + "/", "sglang")])
        assert type(both) is SGLangRollout and both.endpoints == [sglang.url, other.url]  # the repeat served once
    finally:
        other.close()
    one = remote_client([(vllm.url, "vllm")], model="m", retries=1, timeout_s=5.0)
    assert type(one) is VLLMRollout and one.model == "m" and (one.retries, one.timeout_s) == (1, 5.0)
    assert vllm.calls == []  # an explicit kind is not probed


def test_mixed_weight_sync_and_health_reach_every_server(sglang: FakeServer, vllm: FakeServer, tmp_path: Path) -> None:
    client = _mixed(sglang, vllm)
    client.wait_ready(5)
    assert sglang.paths("GET") == ["/health"] and vllm.paths("GET") == ["/health"]
    client.update_weights(str(weights_dir(tmp_path)), 2)
    assert sglang.paths() == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert vllm.paths() == ["/pause?mode=abort", "/collective_rpc", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    client.forget()
    client.close()


def test_mixed_weight_sync_errors_surface_after_every_server_resumed(
    sglang: FakeServer, vllm: FakeServer, tmp_path: Path
) -> None:
    client = _mixed(sglang, vllm, retries=0)
    with pytest.raises(RolloutError, match="update_weights_from_disk"):
        client.update_weights(str(tmp_path / "missing"), 1)  # SGLang refuses a path that is not there
    assert sglang.paths()[-1] == "/continue_generation"
    assert vllm.paths() == []  # vLLM checks the directory itself and is never asked


def test_remote_client_rejects_bad_server_lists(sglang: FakeServer) -> None:
    with pytest.raises(RolloutError, match=r"rollout\.servers"):
        remote_client([])
    with pytest.raises(RolloutError, match=r"rollout\.servers"):
        detect_kind([])
    with pytest.raises(RolloutError, match=r"'tgi'.*sglang, vllm, auto"):
        remote_client([(sglang.url, "sglang"), ("http://127.0.0.1:1", "tgi")])
    with pytest.raises(RolloutError, match="both sglang and vllm"):
        remote_client([(sglang.url, "sglang"), (sglang.url, "vllm")])
    with pytest.raises(RolloutError, match="empty rollout endpoint"):
        remote_client([("", "sglang")])
    assert sglang.calls == []  # a bad list fails before anything is sent


def test_trainer_with_sglang_syncs_weights_every_step(sglang: FakeServer, tmp_path: Path, monkeypatch: Any) -> None:
    """The whole loop against the stand-in: rollouts over HTTP, HF weights exported to the
    checkpoint dir, then pause -> update_weights_from_disk -> continue, once per step."""
    from suite_helpers import small

    from treetrain import config as C
    from treetrain.trainer.loop import Trainer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    raw = small(tmp_path)
    raw["trainer"]["steps"] = 2
    raw["rollout"] = {"weightSync": {"method": "disk"}}
    env = {"TREETRAIN_ROLLOUT_ENDPOINTS": sglang.url}
    trainer = Trainer(C.validate(raw, env=env), log=lambda _: None)
    assert trainer.client is not None and trainer.client.kind == "sglang"  # detected from /model_info
    summary = trainer.run()
    trainer.close()
    assert len(summary.records) == 2
    syncs = [p for p in sglang.paths() if p != "/generate"]
    assert syncs == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"] * 2
    loads = [b["model_path"] for m, p, b in sglang.calls if p == "/update_weights_from_disk"]
    assert loads == [str(tmp_path / "weights" / "v00000001"), str(tmp_path / "weights" / "v00000002")]
    assert (Path(loads[-1]) / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v00000002"]  # older versions pruned
    assert any(Path(loads[-1]).glob("*.safetensors"))


def test_trainer_speaks_to_each_engines_servers_in_their_own_api(
    sglang: FakeServer, vllm: FakeServer, tmp_path: Path, monkeypatch: Any
) -> None:
    """An RLJob with an SGLang and a vLLM engine: the config the operator writes names each
    server's kind, and one training step samples from both and syncs both, each in its API."""
    from suite_helpers import small

    from treetrain import config as C
    from treetrain.trainer.loop import Trainer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    raw = small(tmp_path)
    raw["trainer"]["steps"] = 1
    raw["rollout"] = {
        "servers": [{"url": sglang.url, "kind": "sglang"}, {"url": vllm.url, "kind": "vllm"}],
        "weightSync": {"method": "disk"},
    }
    trainer = Trainer(C.validate(raw), log=lambda _: None)
    assert trainer.client is not None and trainer.client.kind == "sglang+vllm"
    trainer.run()
    trainer.close()
    assert "/generate" in sglang.paths() and "/v1/completions" not in sglang.paths()
    assert "/v1/completions" in vllm.paths() and "/generate" not in vllm.paths()
    assert "/update_weights_from_disk" in sglang.paths() and "/collective_rpc" in vllm.paths()
    assert not [c for c in sglang.calls + vllm.calls if c[1] in ("/model_info", "/v1/models")]  # kinds known: no probe


# -- weight updates during generation, failing servers, many threads -----------------------


def _client(kind: str, urls: list[str], **kwargs: Any) -> SGLangRollout | VLLMRollout:
    return SGLangRollout(endpoints=urls, **kwargs) if kind == "sglang" else VLLMRollout(endpoints=urls, **kwargs)


def _generate_in_thread(
    client: Any, prompts: list[list[int]], params: SamplingParams
) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(client.generate(prompts, params, seed=3))
        except Exception as err:  # handed to the test thread
            out.append(err)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _sent_prompts(server: FakeServer) -> list[tuple[list[int], int]]:
    """(prompt, max new tokens) of every generation request, in order."""
    key = ("input_ids", "prompt")[server.kind == "vllm"]
    return [
        (b[key], b["sampling_params"]["max_new_tokens"] if server.kind == "sglang" else b["max_tokens"])
        for _, p, b in server.calls
        if p in ("/generate", "/v1/completions")
    ]


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_weight_update_interrupts_a_generation_which_resumes_with_itsfake_tokens(kind: str, tmp_path: Path) -> None:
    """The update pauses the server (mode abort) while a request is generating: the reply comes
    back with 2 tokens and finish_reason "abort"; the client waits for the gate to open on version
    1, sends the prompt plus those 2 tokens for the 3 tokens left, and the Generation carries both
    versions, a log-prob for every token."""
    server = FakeServer(kind)
    try:
        server.abort_after = 2
        client = _client(kind, [server.url])
        params = SamplingParams(max_new_tokens=5)
        t, out = _generate_in_thread(client, [[1, 2, 3]], params)
        assert server.generating.wait(30)
        with client.gate.update(1):  # what WeightSync.sync does around the update
            client.update_weights(str(weights_dir(tmp_path)), 1)
        t.join(30)
        (gen,) = out[0]
        first = fake_tokens([1, 2, 3], 2)
        assert gen.tokens == first + fake_tokens([1, 2, 3, *first], 3)
        assert gen.versions == [0, 0, 1, 1, 1] and len(gen.logprobs) == 5 and gen.finish_reason == "length"
        assert _sent_prompts(server) == [([1, 2, 3], 5), ([1, 2, 3, *first], 3)]
        assert client.resubmitted == 1
        # The resubmission waited for the whole update: it follows the resume.
        sync = {
            "sglang": ["/pause_generation", "/update_weights_from_disk", "/continue_generation"],
            "vllm": ["/pause?mode=abort", "/collective_rpc", "/collective_rpc", "/reset_prefix_cache", "/resume"],
        }
        gen_path = "/generate" if kind == "sglang" else "/v1/completions"
        assert server.paths() == [gen_path, *sync[kind], gen_path]
    finally:
        server.close()


def test_an_abort_before_any_token_resubmits_the_whole_prompt(tmp_path: Path) -> None:
    server = FakeServer("vllm")
    try:
        server.abort_after = 0
        client = _client("vllm", [server.url])
        t, out = _generate_in_thread(client, [[4, 4]], PARAMS)
        assert server.generating.wait(30)
        with client.gate.update(7):
            client.update_weights(str(weights_dir(tmp_path)), 7)
        t.join(30)
        (gen,) = out[0]
        assert gen.tokens == fake_tokens([4, 4], 3) and gen.versions == [7, 7, 7]
        assert _sent_prompts(server) == [([4, 4], 3), ([4, 4], 3)]
    finally:
        server.close()


def test_a_dying_server_moves_its_request_to_another_with_the_tokens_so_far() -> None:
    """One server aborts a request outside any weight update (it is shutting down), another refuses
    connections: their requests go on the next endpoint, the partial tokens kept."""
    dying, live = FakeServer("sglang"), FakeServer("vllm")
    dead = FakeServer("sglang")
    dead_url = dead.url
    dead.close()  # nothing listens there now
    try:
        dying.abort_after, dying.wait_for_pause = 1, False
        client = remote_client(
            [(dying.url, "sglang"), (dead_url, "sglang"), (live.url, "vllm")], retries=1, timeout_s=10.0
        )
        for c in client.clients:  # type: ignore[attr-defined]
            c.retry_backoff_s = 0.01
        gens = client.generate([[1], [2], [3]], PARAMS, seed=0)
        head = fake_tokens([1], 1)
        assert gens[0].tokens == head + fake_tokens([1, *head], 2)  # 1 token on the dying server, 2 on the next
        assert gens[0].versions == [0, 0, 0]
        assert gens[1].tokens == fake_tokens([2], 3) and gens[2].tokens == fake_tokens([3], 3)
        assert sorted(_sent_prompts(live)) == [([1, *head], 2), ([2], 3), ([3], 3)]
        assert client.resubmitted == 3  # prompt 0 twice (dying, then dead), prompt 1 once (dead)
    finally:
        dying.close()
        live.close()


def test_a_request_fails_only_when_every_server_failed() -> None:
    flaky = [FakeServer("sglang", fail_first=10), FakeServer("sglang", fail_first=10)]
    try:
        client = SGLangRollout(endpoints=[s.url for s in flaky], retries=0)
        with pytest.raises(RolloutError, match=r"every rollout server failed.*HTTP 503.*HTTP 503"):
            client.generate([[1]], PARAMS, seed=0)
        assert [s.paths().count("/generate") for s in flaky] == [1, 1]
    finally:
        for s in flaky:
            s.close()


def test_many_threads_generate_at_once_and_the_round_robin_stays_even() -> None:
    servers = [FakeServer("sglang"), FakeServer("sglang")]
    try:
        client = SGLangRollout(endpoints=[s.url for s in servers])
        barrier = threading.Barrier(8)
        results: dict[int, Any] = {}

        def run(k: int) -> None:
            barrier.wait(30)
            results[k] = client.generate([[k, i] for i in range(4)], PARAMS, seed=k)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == list(range(8))
        for k, gens in results.items():
            assert [g.tokens for g in gens] == [fake_tokens([k, i], 3) for i in range(4)]
            assert all(g.versions == [0, 0, 0] for g in gens)
        assert [len(s.paths()) for s in servers] == [16, 16]  # every call took its block of the cursor
    finally:
        for s in servers:
            s.close()


def test_no_request_is_sent_while_the_gate_is_closed(sglang: FakeServer) -> None:
    """A request that arrives during an update waits for it and is labelled with the new version."""
    client = SGLangRollout(endpoints=[sglang.url])
    with client.gate.update(4):
        t, out = _generate_in_thread(client, [[5]], PARAMS)
        assert not sglang.calls  # the request waits at the gate (it has not been sent)
    t.join(30)
    assert out[0][0].versions == [4, 4, 4] and len(sglang.paths()) == 1
