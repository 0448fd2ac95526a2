"""LoRA is exact on every engine and layout: a tree-packed and a flat batch give the loss, the
adapter's gradients and the log-probs of each sequence alone through transformers (fp32;
loss and gradients relative 1e-4, log-probs 1e-5), a new adapter (B = 0) leaves the base
model's log-probs bit for bit, and an exported adapter loads in PEFT over the base model
with the engine's log-probs (1e-4).

The reference is the model with the adapter merged in (``W + s B A``), each sequence alone
through transformers; the adapter's gradients follow from the merged weight's
(:mod:`helpers.lora`). The adapter is random (``B`` not zero) and loaded into every engine
with ``load_adapter`` (a PEFT directory), so the loading is tested on every layout too.

Layouts: one process runs ``fsdp:d1``, ``archon:d1`` and ``megatron:d1`` (and the MoE model on
Archon and Megatron); two gloo processes per engine run ``fsdp:d2``, ``t2``; ``archon:t2``, ``p2``,
``c2``, ``(attn:d2|ffn:e2)``; ``megatron:t2``, ``p2`` (tied Qwen2), ``c2``, ``d2`` (ZeRO-1 over the
adapter), ``(attn:t2|ffn:e2)``. A failed layout does not hide the others."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import spawn_ranks
from helpers.lora import adapter_reference, grad_problems, lora_settings, save_adapter, save_merged
from megatron_models import SumLogprobLoss, branching_sequences, make_batch, save_model

TREE = {"max_tokens_per_mb": 64, "block_size": 16}
SINGLE = [
    ("qwen3", "fsdp:d1"),
    ("qwen3", "archon:d1"),
    ("qwen3_moe", "archon:d1"),
    ("qwen3", "megatron:d1"),
    ("qwen3_moe", "megatron:d1"),
]
TWO = {
    "fsdp": [("qwen3", "fsdp:d2"), ("qwen3", "fsdp:t2")],
    "archon": [
        ("qwen3", "archon:t2"),
        ("qwen2", "archon:p2"),
        ("llama", "archon:c2"),
        ("qwen3_moe", "archon:(attn:d2|ffn:e2)"),
    ],
    "megatron": [
        ("qwen3", "megatron:t2"),
        ("qwen2", "megatron:p2"),
        ("llama", "megatron:c2"),
        ("qwen3", "megatron:d2"),  # ZeRO-1 over the adapter
        ("qwen3_moe", "megatron:(attn:t2|ffn:e2)"),
    ],
}


def _batch() -> Any:
    return make_batch(branching_sequences() + branching_sequences(seed=1))


def _prepare(root: Path, families: set[str]) -> None:
    """Each model, a random adapter, the merged model and its reference, once (not per rank)."""
    for family in families:
        path = save_model(family, root)
        adapter = save_adapter(path, root / f"{family}-adapter")
        merged = save_merged(path, adapter, root / f"{family}-merged")
        value, grads, logps = adapter_reference(merged, adapter, _batch(), SumLogprobLoss())
        torch.save({"loss": value, "grads": grads, "logps": logps}, root / f"{family}-ref.pt")


def _engine(root: Path, family: str, backend: str, *, lora: bool = True, optimizer: bool = True) -> Any:
    from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine

    if backend.startswith("megatron:"):
        from treetrain.engines.megatron.parallel import reset_megatron

        reset_megatron()
    return build_engine(
        ModelSettings(path=str(root / family)),
        backend,
        tree=TreeTrainingSettings(**TREE),
        optimizer=OptimizerSettings(lr=1e-3) if optimizer else None,
        lora=lora_settings() if lora else None,
    )


def _check(family: str, backend: str, root: Path) -> None:
    from treetrain.engines.lora.linear import is_adapter

    ref = torch.load(root / f"{family}-ref.pt")
    batch = _batch()
    # A new adapter (B = 0) is the base model, bit for bit.
    base = _engine(root, family, backend, lora=False, optimizer=False).forward(batch.sequences)
    engine = _engine(root, family, backend)
    # The optimizer steps the adapter alone (ZeRO-1's shards on megatron:d2 too); the base is frozen.
    stepped = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    adapter = {id(p) for name, p in engine.model.named_parameters() if is_adapter(name)}
    assert adapter and stepped == adapter, (backend, "the optimizer must hold the adapter only")
    assert all(p.requires_grad == (id(p) in adapter) for p in engine.model.parameters()), (backend, "base frozen")
    fresh = engine.forward(batch.sequences)
    assert all(torch.equal(x, y) for x, y in zip(base, fresh, strict=True)), (backend, "B = 0 is not the base")
    engine.load_adapter(root / f"{family}-adapter")
    for tree in (True, False):
        stats = engine.forward_backward(batch, SumLogprobLoss(), tree=tree)
        if tree:
            assert stats.tree_tokens < stats.original_tokens, (backend, "the batch must share prefixes")
        assert abs(stats.loss - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (backend, tree, stats.loss, ref["loss"])
        grads = engine.adapter_grads()
        wrong = grad_problems(grads, ref["grads"])
        assert not wrong, f"{backend} tree={tree}: {len(wrong)} adapter gradients differ:\n" + "\n".join(wrong)
        # The clipping norm counts each adapter element once, however the layout splits or copies it.
        want = sum(float((a.double() ** 2).sum() + (b.double() ** 2).sum()) for a, b in grads.values()) ** 0.5
        assert abs(float(engine.grad_norm()) - want) <= 1e-5 * want, (backend, tree, float(engine.grad_norm()), want)
        engine.zero_grad()
    for i, (got, want) in enumerate(zip(engine.forward(batch.sequences), ref["logps"], strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{backend} log-probs of sequence {i}")


def _checks(root: str, cases: list[tuple[str, str]]) -> None:
    failed = []
    for family, backend in cases:
        try:
            _check(family, backend, Path(root))
        except Exception:
            failed.append(f"{backend} ({family})\n{traceback.format_exc()}")
    if failed:
        raise AssertionError(f"{len(failed)} of {len(cases)} layouts failed:\n" + "\n".join(failed))


@pytest.mark.slow
def test_lora_is_exact_on_one_rank_of_every_engine(tmp_path: Path) -> None:
    _prepare(tmp_path, {f for f, _ in SINGLE})
    _checks(str(tmp_path), SINGLE)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO))
def test_lora_is_exact_on_two_ranks(name: str, tmp_path: Path) -> None:
    cases = TWO[name]
    _prepare(tmp_path, {f for f, _ in cases})
    spawn_ranks(_checks, 2, str(tmp_path), cases)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp:d1", "archon:d1", "megatron:d1"])
def test_an_exported_adapter_loads_in_peft_with_the_engines_logprobs(backend: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = save_model("qwen3", tmp_path)
    engine = _engine(tmp_path, "qwen3", backend)
    batch = _batch()
    engine.forward_backward(batch, SumLogprobLoss())
    engine.step()  # B moves off zero
    engine.export_adapter(tmp_path / "exported")
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tmp_path / "exported"
    )
    mine = engine.forward(batch.sequences)
    with torch.no_grad():
        for seq, got in zip(batch.sequences, mine, strict=True):
            ids = torch.tensor(seq)[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            want = logp[torch.arange(len(seq) - 1), ids[0, 1:]]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (
        max(
            float((a - b).abs().max())
            for a, b in zip(
                mine,
                _engine(tmp_path, "qwen3", backend, lora=False, optimizer=False).forward(batch.sequences),
                strict=True,
            )
        )
        > 1e-4
    )
