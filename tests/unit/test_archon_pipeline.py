"""Pipeline parallel in the Archon engine: the cost-balanced layer split and the step padding
(pure), then ``archon:p2`` on 2 CPU processes over gloo: tree-packed vs flat vs each sequence
alone through the Hugging Face model (log-probs <= 1e-5 abs, loss and gradient norm relative
<= 1e-4) over two steps whose trees differ in size, with tied embeddings split over the two
stages; the reference role; the critic tree and flat vs each sequence alone; a Hugging Face
round trip; an exact resume (DCP)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_batch
from helpers.archon import (
    SEQS,
    build_critic,
    check_logprobs,
    check_tree_and_flat,
    hf_config,
    hf_logprobs,
    hf_reference,
    spawn_cases,
)

from treetrain.engines.archon.model import ModelArgs
from treetrain.engines.archon.pipeline import head_cost, layer_costs, pad_tree, split_layers, stage_layers
from treetrain.tree import PackConfig, pack

TREE = {"max_tokens_per_mb": 64, "block_size": 16}


# -- the layer split (pure) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("costs", "stages", "first", "last", "want"),
    [
        ([1.0] * 4, 2, 0.0, 0.0, [(0, 2), (2, 4)]),
        ([1.0] * 5, 2, 0.0, 0.0, [(0, 3), (3, 5)]),  # a tie: the earlier stage takes more
        ([1.0] * 6, 3, 0.0, 0.0, [(0, 2), (2, 4), (4, 6)]),
        ([1.0] * 8, 2, 0.0, 2.0, [(0, 5), (5, 8)]),  # a heavy head: fewer layers on the last stage
        ([1.0] * 8, 2, 2.0, 0.0, [(0, 3), (3, 8)]),  # a heavy embedding stage
        ([4.0, 1.0, 1.0, 1.0, 1.0], 2, 0.0, 0.0, [(0, 1), (1, 5)]),  # one costly layer (an MoE) alone
        ([1.0, 1.0], 2, 0.0, 100.0, [(0, 1), (1, 2)]),  # every stage keeps a layer
        ([3.0], 1, 0.0, 5.0, [(0, 1)]),
    ],
)
def test_split_layers_minimises_the_costliest_stage(
    costs: list[float], stages: int, first: float, last: float, want: list[tuple[int, int]]
) -> None:
    got = split_layers(costs, stages, first=first, last=last)
    assert [(r.start, r.stop) for r in got] == want


def _worst(costs: list[float], cuts: tuple[int, ...], first: float, last: float) -> float:
    bounds = [0, *cuts, len(costs)]
    parts = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
    parts[0] += first
    parts[-1] += last
    return max(parts)


def test_split_layers_is_optimal_against_every_split() -> None:
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(2, 9)
        stages = rng.randint(1, min(4, n))
        costs = [rng.uniform(0.5, 3.0) for _ in range(n)]
        first, last = rng.uniform(0, 2), rng.uniform(0, 4)
        best = min(_worst(costs, c, first, last) for c in itertools.combinations(range(1, n), stages - 1))
        got = split_layers(costs, stages, first=first, last=last)
        assert got[0].start == 0 and got[-1].stop == n and all(len(r) >= 1 for r in got)
        assert all(a.stop == b.start for a, b in itertools.pairwise(got))
        assert _worst(costs, tuple(r.start for r in got[1:]), first, last) == pytest.approx(best)


def test_split_layers_refuses_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match="at least 3 layers"):
        split_layers([1.0, 1.0], 3)


def _args(**fields: Any) -> ModelArgs:
    base: dict[str, Any] = {
        "family": "llama",
        "vocab_size": 32000,
        "dim": 512,
        "n_layers": 8,
        "n_heads": 8,
        "n_kv_heads": 8,
        "head_dim": 64,
        "ffn_dim": 1408,
        "norm_eps": 1e-6,
        "rope_theta": 1e4,
    }
    return ModelArgs(**{**base, **fields})


def test_costs_weigh_attention_the_head_and_experts() -> None:
    args = _args()
    short, long = layer_costs(args, 1024), layer_costs(args, 16384)
    # Attention grows with the tree, so a layer outweighs the head more for long trees.
    assert long[0] / head_cost(args, 16384, value_head=False) > short[0] / head_cost(args, 1024, value_head=False)
    assert head_cost(args, 1024, value_head=True) < head_cost(args, 1024, value_head=False) / 100
    moe = _args(n_experts=64, top_k=8, moe_ffn_dim=1408, moe_layers=(3,))
    costs = layer_costs(moe, 1024)
    assert costs[3] > costs[2] and costs[2] == costs[0]
    # A large vocabulary on short trees: the last stage gives up layers; on long trees attention
    # dominates and it gives up fewer; a value head costs nothing.
    assert [len(r) for r in stage_layers(args, 2, tokens=512, value_head=False)] == [6, 2]
    assert [len(r) for r in stage_layers(args, 2, tokens=16384, value_head=False)] == [5, 3]
    assert [len(r) for r in stage_layers(args, 2, tokens=512, value_head=True)] == [4, 4]


@pytest.mark.parametrize(
    ("backend", "fields", "match"),
    [
        ("archon:p4", {"n_layers": 2}, "p4 needs at least 4 layers"),
        (
            "archon:p2",
            {"n_experts": 4, "top_k": 2, "moe_ffn_dim": 32, "moe_layers": (0, 1), "use_aux_loss": True},
            "load-balancing loss",
        ),
    ],
)
def test_pipeline_refusals(backend: str, fields: dict[str, Any], match: str) -> None:
    from treetrain.alloc import parse
    from treetrain.engines import EngineConfigError
    from treetrain.engines.archon.engine import _check_layout
    from treetrain.engines.archon.layout import ArchonLayout

    allocation = parse(backend)
    layout = ArchonLayout(allocation=allocation, world_size=allocation.world_size, rank=0, device=torch.device("cpu"))
    with pytest.raises(EngineConfigError, match=match):
        _check_layout(_args(family="qwen3_moe" if "n_experts" in fields else "llama", **fields), layout)


def test_padding_a_tree_keeps_its_tokens_and_masks_the_rest() -> None:
    tree = pack(SEQS, PackConfig(max_tokens_per_mb=64, block_size=16)).trees[0]
    padded = pad_tree(tree, tree.padded_len + 32)
    assert padded.padded_len == tree.padded_len + 32 and padded.num_tokens == tree.num_tokens
    n = tree.padded_len
    assert padded.input_ids[:n] == tree.input_ids and padded.token_end[:n] == tree.token_end
    assert padded.token_end[n:] == list(range(n + 1, n + 33))  # each attends only to itself
    assert padded.seq_tokens == tree.seq_tokens and padded.seq_offsets == tree.seq_offsets
    assert pad_tree(tree, tree.padded_len) is tree


# -- p2 on 2 processes -----------------------------------------------------------------------


def _batches() -> list[Any]:
    """Two steps whose trees differ in size (the second keeps a few shorter sequences)."""
    from treetrain.engines.batch import TrainBatch

    full = make_batch(vocab=128)
    keep = [0, 3, 9]
    small = TrainBatch(
        sequences=[full.sequences[i] for i in keep],
        loss_mask=[full.loss_mask[i] for i in keep],
        fields=full.fields.map(lambda v: [v[i] for i in keep]),
    )
    return [full, small]


def _check_actor(model_dir: str, backend: str, tmp: Path) -> None:
    from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine
    from treetrain.rl.losses import PPOLoss

    loss = PPOLoss(LossSettings(clip_eps=0.2))
    tree = TreeTrainingSettings(**TREE)
    engine = build_engine(ModelSettings(path=model_dir), backend, tree=tree, optimizer=OptimizerSettings(lr=1e-3))
    assert engine.layout.pp == 2
    sizes = []
    for batch in _batches():
        sizes.append(sorted({t.padded_len for t in engine.pack(batch.sequences).trees}))
        reference = hf_reference(model_dir, "actor", batch, loss)
        check_tree_and_flat(engine, batch, loss, reference, engine.norm_params, backend)
        want = hf_logprobs(model_dir, batch.sequences)
        check_logprobs(engine, batch.sequences, want)
    assert sizes[0] != sizes[1] and len(sizes[0]) > 1, sizes  # uneven trees in a step, and between steps
    # The reference role: forward only (no optimizer), the same log-probs.
    ref = build_engine(ModelSettings(path=model_dir), backend, role="ref", tree=tree)
    for got, want_lp in zip(ref.forward(batch.sequences), want, strict=True):
        torch.testing.assert_close(got, want_lp, rtol=0, atol=1e-5)

    batch = _batches()[0]
    # Tied embeddings over two stages: both copies got the same summed gradient and stay equal.
    engine.forward_backward(batch, loss)
    grads = engine.full_grads()
    torch.testing.assert_close(grads["tok_embeddings.weight"], grads["output.weight"], rtol=0, atol=0)
    engine.step()
    state = engine.full_state()
    torch.testing.assert_close(state["tok_embeddings.weight"], state["output.weight"], rtol=0, atol=0)

    # Hugging Face round trip: export every stage, reload in transformers, the same tensors.
    exported = tmp / "export-p2"
    engine.export_hf(exported)
    if engine.layout.is_main:
        from transformers import AutoModelForCausalLM

        from treetrain.engines.archon.model.hf import to_hf

        hf = AutoModelForCausalLM.from_pretrained(exported).state_dict()
        for name, t in to_hf(state, tie_embeddings=True).items():
            torch.testing.assert_close(hf[name], t, rtol=0, atol=0)

    # Exact resume: DCP restores every stage's model and optimizer; the next step repeats.
    ckpt = tmp / "ckpt-p2"
    engine.save(ckpt, {"step": 1})
    after = []
    for _ in range(2):
        engine.forward_backward(batch, loss)
        after.append(engine.step())
        after.append(engine.forward_backward(batch, loss).loss)
        engine.zero_grad()
        assert engine.load(ckpt) == {"step": 1}
    assert after[:2] == after[2:], after


def _check_critic(model_dir: str, backend: str) -> None:
    from treetrain.config import ValueLossSettings
    from treetrain.rl.losses import ValueLoss

    loss = ValueLoss(ValueLossSettings())
    critic = build_critic(model_dir, backend, TREE)
    for batch in _batches():
        reference = hf_reference(model_dir, "critic", batch, loss)
        check_tree_and_flat(critic, batch, loss, reference, critic.norm_params, f"{backend} critic")
        tree_v, flat_v = critic.forward(batch.sequences, tree=True), critic.forward(batch.sequences, tree=False)
        for a, b in zip(tree_v, flat_v, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_pipeline_two_stages(tmp_path: Path) -> None:
    # qwen3 ties its embeddings (the gradient is summed over the first and last stage).
    cases = [("qwen3", "archon:p2", "actor"), ("llama", "archon:p2", "critic")]
    spawn_cases(tmp_path, cases, _check_actor, _check_critic)
    assert ModelArgs.from_hf(hf_config("qwen3")).tie_embeddings
