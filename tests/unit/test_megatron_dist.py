"""The Megatron engine on 2 CPU processes over gloo, built with
:func:`treetrain.engines.build_engine`, for every letter: ``t2`` (with sequence parallel),
``d2``, ``p2`` (trees of different sizes in one step), ``c2`` and the hybrids
``(attn:d2|ffn:e2)`` and ``(attn:t2|ffn:e2)`` (sequence parallel into expert parallel) on a
tiny Qwen3-MoE, with recompute on and off (``t2``, ``p2``, ``c2`` and the hybrids both ways,
``d2`` on; ``d1`` both ways in ``test_megatron.py``). For each: tree-packed and flat loss and
gradients equal each sequence run alone through the Hugging Face model (fp32: loss and
gradients relative <= 1e-4, log-probs <= 1e-5 abs), the one-collective gradient norm equals
the reference's, ``export_hf`` reloads in transformers with identical tensors, and a
checkpoint resumes exactly. The critic (value head, ``t2``: its rows all-gathered from the
sequence-parallel region) equals each sequence alone through the backbone and the same head,
tree and flat; the reference role only runs forwards.

No test-only patch: on CPU the engine itself points megatron-core's CUDA-only calls (sequence
parallel's collectives, the MoE router) at the CPU (``parallel.cpu_adapter``), exactly as
``treetrain train`` runs there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import losses_after_resume, spawn_ranks
from megatron_models import branching_sequences, critic_reference, make_batch, per_expert, reference, save_model

# 64-token trees over 16-token blocks: several uneven micro-batches per rank.
TREE = {"max_tokens_per_mb": 64, "block_size": 16}
# (family, backend, recompute settings): one spawn per row, each setting built in turn.
CASES = [
    ("qwen3", "megatron:t2", (False, True)),
    ("qwen2", "megatron:d2", (True,)),
    ("llama", "megatron:p2", (False,)),
    ("qwen2", "megatron:p2", (True,)),
    ("llama", "megatron:c2", (False, True)),
    ("qwen3_moe", "megatron:(attn:d2|ffn:e2)", (True,)),
    ("qwen3_moe", "megatron:(attn:t2|ffn:e2)", (False,)),
]


def _check(family: str, backend: str, recompute: bool, root: Path) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine
    from treetrain.engines.megatron.parallel import reset_megatron
    from treetrain.rl.losses import PPOLoss

    reset_megatron()
    path = root / family
    where = f"{family} {backend} recompute={recompute}"
    loss = PPOLoss(LossSettings(clip_eps=0.2))
    batch = make_batch(branching_sequences() + branching_sequences(seed=1))
    model = ModelSettings(path=str(path), gradient_checkpointing=recompute)
    tree = TreeTrainingSettings(**TREE)
    engine = build_engine(model, backend, tree=tree, optimizer=OptimizerSettings(lr=1e-3))
    assert engine.model.config.sequence_parallel == (engine.layout.tp > 1), where
    ref_loss, ref_grads, ref_logps = reference(path, batch, loss)
    ref_grads = per_expert(ref_grads)
    ref_norm = float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in ref_grads.values()])))
    micro = {}
    for use_tree in (True, False):
        stats = engine.forward_backward(batch, loss, tree=use_tree)
        micro[use_tree] = stats.micro_batches
        assert abs(stats.loss - ref_loss) <= 1e-4 * abs(ref_loss) + 1e-7, (where, use_tree, stats.loss, ref_loss)
        grads = engine.full_grads()
        assert set(grads) == set(ref_grads), (where, set(grads) ^ set(ref_grads))
        for n, ref in ref_grads.items():
            torch.testing.assert_close(grads[n], ref, rtol=1e-4, atol=1e-6, msg=f"{where} tree={use_tree} {n}")
        norm = float(engine.grad_norm())
        assert abs(norm - ref_norm) <= 1e-4 * ref_norm, (where, norm, ref_norm)
        engine.zero_grad()
    assert micro[False] > micro[True] >= 1, micro
    for use_tree in (True, False):
        for got, want in zip(engine.forward(batch.sequences, tree=use_tree), ref_logps, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{where} forward tree={use_tree}")
    # export_hf gathers every shard: the directory reloads with tensors identical to the source.
    tag = f"{family}-{backend.replace(':', '-')}-{recompute}"
    out = root / f"export-{tag}"
    engine.export_hf(out)
    if dist.get_rank() == 0:
        src = AutoModelForCausalLM.from_pretrained(path).state_dict()
        got = AutoModelForCausalLM.from_pretrained(out).state_dict()
        assert set(src) == set(got)
        for n, t in src.items():
            assert torch.equal(got[n], t), (where, n)
    # A checkpoint restores model and optimizer: the next step repeats exactly.
    engine.forward_backward(batch, loss)
    engine.step()
    after = losses_after_resume(engine, batch, loss, root / f"ckpt-{tag}")
    assert after[0] == after[1], (where, after)


def _check_critic_and_ref(family: str, backend: str, root: Path) -> None:
    from treetrain.config import (
        LossSettings,
        ModelSettings,
        OptimizerSettings,
        TreeTrainingSettings,
        ValueLossSettings,
    )
    from treetrain.engines import build_engine
    from treetrain.engines.megatron.parallel import reset_megatron
    from treetrain.rl.losses import PPOLoss, ValueLoss

    reset_megatron()
    path = root / family
    loss = ValueLoss(ValueLossSettings(clip_eps=None))
    batch = make_batch(branching_sequences() + branching_sequences(seed=1))
    model, tree = ModelSettings(path=str(path)), TreeTrainingSettings(**TREE)
    critic = build_engine(model, backend, tree=tree, optimizer=OptimizerSettings(lr=1e-3), role="critic")
    head = critic.model.gpt.output_layer
    ref_loss, ref_grads, ref_values = critic_reference(path, batch, loss, {"weight": head.weight, "bias": head.bias})
    for use_tree in (True, False):
        where = f"critic {family} {backend} tree={use_tree}"
        stats = critic.forward_backward(batch, loss, tree=use_tree)
        assert abs(stats.loss - ref_loss) <= 1e-4 * abs(ref_loss) + 1e-7, (where, stats.loss, ref_loss)
        grads = critic.full_grads()
        assert set(grads) == set(ref_grads), (where, set(grads) ^ set(ref_grads))
        for n, want in ref_grads.items():
            torch.testing.assert_close(grads[n], want, rtol=1e-4, atol=1e-6, msg=f"{where} {n}")
        critic.zero_grad()
        for got, want in zip(critic.forward(batch.sequences, tree=use_tree), ref_values, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{where} values")
    # The reference role shares the parallel state, runs forwards and refuses to train.
    ref = build_engine(model, backend, tree=tree, role="ref")
    _, _, ref_logps = reference(path, batch, PPOLoss(LossSettings(clip_eps=0.2)))
    for got, want in zip(ref.forward(batch.sequences), ref_logps, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"ref {family} {backend}")
    with pytest.raises(RuntimeError, match="without an optimizer"):
        ref.forward_backward(batch, loss)


def _checks(root: str, cases: list[tuple[str, str, Any]]) -> None:
    for family, backend, settings in cases:
        if settings == "critic":
            _check_critic_and_ref(family, backend, Path(root))
            continue
        for recompute in settings:
            _check(family, backend, recompute, Path(root))


def _spawn(cases: list[tuple[str, str, Any]], root: Path) -> None:
    for family in {c[0] for c in cases}:
        save_model(family, root)
    spawn_ranks(_checks, 2, str(root), cases)


def _case_id(family: str, backend: str, recompute: tuple[bool, ...]) -> str:
    return f"{family}-{backend}-" + "+".join("recompute" if r else "plain" for r in recompute)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[_case_id(*c) for c in CASES])
def test_two_ranks_match_each_sequence_alone(case: tuple[str, str, tuple[bool, ...]], tmp_path: Path) -> None:
    _spawn([case], tmp_path)


@pytest.mark.slow
def test_two_ranks_critic_and_ref_match_each_sequence_alone(tmp_path: Path) -> None:
    _spawn([("qwen3", "megatron:t2", "critic")], tmp_path)
