"""The Archon engine on 2 CPU processes over gloo, built with ``build_engine``: tree-packed vs
flat vs each sequence alone through the Hugging Face model (log-probs <= 1e-5 abs, gradients
and their norm relative <= 1e-4) for d2, t2 and c2 (Ulysses, and gathered K/V when c does not
divide the heads), the critic tree vs flat, the same loss and gradient norm as the FSDP
engine, a Hugging Face round trip from t2, and an exact resume (DCP) from d2 and from t2 into a
fresh engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import losses_after_resume, make_batch
from helpers.archon import (
    build_critic,
    check_logprobs,
    check_tree_and_flat,
    hf_config,
    hf_logprobs,
    hf_reference,
    spawn_cases,
)

TREE = {"max_tokens_per_mb": 64, "block_size": 16}


def _check_actor(model_dir: str, backend: str, tmp: Path) -> None:
    from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine
    from treetrain.rl.losses import PPOLoss

    loss = PPOLoss(LossSettings(clip_eps=0.2))
    batch = make_batch(vocab=128)
    tree = TreeTrainingSettings(**TREE)
    engine = build_engine(ModelSettings(path=model_dir), backend, tree=tree, optimizer=OptimizerSettings(lr=1e-3))
    reference = hf_reference(model_dir, "actor", batch, loss)
    check_tree_and_flat(engine, batch, loss, reference, engine.model.parameters, backend)
    check_logprobs(engine, batch.sequences, hf_logprobs(model_dir, batch.sequences))
    if backend == "archon:t2":
        # Hugging Face round trip: export, load in a new engine, same log-probs.
        engine.forward_backward(batch, loss)
        engine.step()
        name = Path(model_dir).name
        exported = tmp / f"export-t2-{name}"
        engine.export_hf(exported)
        again = build_engine(str(exported), backend, tree=tree)
        for got, ref in zip(again.forward(batch.sequences), engine.forward(batch.sequences), strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        # Exact resume into a fresh engine (a restarted run): the weights it loads, then the
        # next step's loss and gradient norm and the loss after it, bit for bit.
        ckpt = tmp / f"ckpt-t2-{name}"
        engine.save(ckpt, {"step": 1})
        saved = {k: v.clone() for k, v in engine.full_state().items()}  # clone: CPU tensors alias
        want = _next_step(engine, batch, loss)
        fresh = build_engine(ModelSettings(path=model_dir), backend, tree=tree, optimizer=OptimizerSettings(lr=1e-3))
        assert fresh.load(ckpt) == {"step": 1}
        for key, value in fresh.full_state().items():
            assert torch.equal(value, saved[key]), key
        got = _next_step(fresh, batch, loss)
        assert got == want, (got, want)
    if backend == "archon:d2":
        # The FSDP engine on the same model: the same loss and gradient norm for one step.
        fsdp = build_engine(ModelSettings(path=model_dir), "fsdp:d2", tree=tree, optimizer=OptimizerSettings(lr=1e-3))
        a, f = engine.forward_backward(batch, loss), fsdp.forward_backward(batch, loss)
        assert abs(a.loss - f.loss) <= 1e-6, (a.loss, f.loss)
        assert engine.step() == pytest.approx(fsdp.step(), rel=1e-4)
        # Exact resume: DCP restores model and optimizer; the next step repeats bit for bit.
        after = losses_after_resume(engine, batch, loss, tmp / "ckpt-d2")
        assert after[0] == after[1], after


def _next_step(engine: Any, batch: Any, loss: Any) -> tuple[float, float, float]:
    """One optimizer step from where ``engine`` stands: its loss, gradient norm, and the loss
    after it."""
    first = engine.forward_backward(batch, loss).loss
    norm = engine.step()
    after = engine.forward_backward(batch, loss).loss
    engine.zero_grad()
    return first, norm, after


def _check_critic(model_dir: str, backend: str) -> None:
    from treetrain.config import ValueLossSettings
    from treetrain.engines.grads import grad_norm
    from treetrain.rl.losses import ValueLoss

    loss = ValueLoss(ValueLossSettings())
    batch = make_batch(vocab=128)
    critic = build_critic(model_dir, backend, TREE)
    results = []
    for use_tree in (True, False):
        stats = critic.forward_backward(batch, loss, tree=use_tree)
        results.append((stats.loss, grad_norm(critic.model.parameters())))
        critic.zero_grad()
    (tl, tn), (fl, fn) = results
    assert abs(tl - fl) <= 1e-5 * abs(fl), (tl, fl)
    torch.testing.assert_close(tn, fn, rtol=1e-4, atol=0)
    tree_v, flat_v = critic.forward(batch.sequences, tree=True), critic.forward(batch.sequences, tree=False)
    for a, b in zip(tree_v, flat_v, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


# t2 on qwen2 (q/k/v biases) and qwen3 (per-head q/k norms, tied embeddings: both once
# drifted apart over the tensor ranks, which a resume exposed).
TP_CASES = [("qwen3", "archon:d2", "actor"), ("qwen2", "archon:t2", "actor"), ("qwen3", "archon:t2", "actor")]
# qwen3: 4 heads, 2 kv heads (Ulysses); llama3: 3 heads (c2 does not divide: gathered K/V).
CP_CASES = [("qwen3", "archon:c2", "actor"), ("llama3", "archon:c2", "actor"), ("qwen3", "archon:c2", "critic")]


@pytest.mark.slow
def test_data_and_tensor_parallel(tmp_path: Path) -> None:
    spawn_cases(tmp_path, [*TP_CASES, ("llama", "archon:d2", "critic")], _check_actor, _check_critic)


@pytest.mark.slow
def test_context_parallel(tmp_path: Path) -> None:
    spawn_cases(tmp_path, CP_CASES, _check_actor, _check_critic)


def _archon_model(family: str) -> Any:
    """The Archon model the engine builds from ``family``'s tiny config (random weights)."""
    from treetrain.engines.archon.model import ModelArgs, Transformer

    return Transformer(ModelArgs.from_hf(hf_config(family)))


def test_the_cases_exercise_what_they_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slow tests above are only as good as their cases: on the models the engine builds
    from FAMILY_CONFIGS, the t2 cases hold q/k/v biases, per-head q/k norms and tied
    embeddings, and context parallel on the c2 cases swaps in both of its attention paths
    (Ulysses and gathered K/V)."""
    import torch.distributed as dist

    from treetrain.engines.archon.parallelize import GatheredKVAttention, UlyssesAttention, apply_cp

    tp = [_archon_model(family) for family, backend, _ in TP_CASES if backend == "archon:t2"]
    attentions = [block.attention for model in tp for block in model.layers.values()]
    assert any(a.wq.bias is not None and a.wk.bias is not None and a.wv.bias is not None for a in attentions)
    assert any(a.q_norm is not None and a.k_norm is not None for a in attentions)
    assert any(model.args.tie_embeddings for model in tp)
    # Gathered K/V asks for its rank at construction; no process group is needed to pick the path.
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    cores: dict[str, set[type]] = {}
    for family, _, role in CP_CASES:
        if role == "actor":
            model = _archon_model(family)
            apply_cp(model, group=None, size=2)  # type: ignore[arg-type]
            cores[family] = {type(block.attention.core) for block in model.layers.values()}
    assert cores == {"qwen3": {UlyssesAttention}, "llama3": {GatheredKVAttention}}, cores
