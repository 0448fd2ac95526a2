"""The Megatron engine in one process (``megatron:d1``): the parallel-state mapping for every
letter, log-probs and gradients equal each sequence alone through transformers (recompute off
and on), and the RoPE regression (later branches of a tree need tree positions, not flat
ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_models import branching_sequences, make_batch, reference, save_model

from treetrain.alloc import parse
from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
from treetrain.engines import build_engine
from treetrain.rl.losses import PPOLoss

TREE = TreeTrainingSettings(max_tokens_per_mb=64, block_size=16)


pytestmark = pytest.mark.usefixtures("megatron_one_process")


@pytest.mark.parametrize(
    ("backend", "want"),
    [
        ("megatron:d4", (1, 1, 1, 1, 1)),
        ("megatron:t2", (2, 1, 1, 1, 1)),
        ("megatron:p2", (1, 2, 1, 1, 1)),
        ("megatron:c2", (1, 1, 2, 1, 1)),
        ("megatron:d2e2", (1, 1, 1, 2, 1)),
        ("megatron:d2p2t2c2", (2, 2, 2, 1, 1)),
        ("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)", (2, 2, 2, 2, 4)),
    ],
)
def test_every_letter_maps_to_megatron(backend: str, want: tuple[int, ...]) -> None:
    from treetrain.engines.megatron import megatron_sizes

    got = megatron_sizes(parse(backend))
    names = ("tensor", "pipeline", "context", "expert", "expert_tensor")
    assert (
        tuple(got[f"{n}_{'model_' if n in ('tensor', 'pipeline', 'expert') else ''}parallel_size"] for n in names)
        == want
    )


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_d1_matches_each_sequence_alone_and_needs_tree_positions(recompute: bool, tmp_path: Path) -> None:
    path = save_model("qwen3", tmp_path)
    loss = PPOLoss(LossSettings(clip_eps=0.2))
    batch = make_batch(branching_sequences())
    model = ModelSettings(path=str(path), gradient_checkpointing=recompute)
    engine = build_engine(model, "megatron:d1", tree=TREE, optimizer=OptimizerSettings())
    assert not engine.model.config.sequence_parallel  # no tensor ranks: nothing to split
    ref_loss, ref_grads, ref_logps = reference(path, batch, loss)
    for use_tree in (True, False):
        stats = engine.forward_backward(batch, loss, tree=use_tree)
        assert abs(stats.loss - ref_loss) <= 1e-4 * abs(ref_loss) + 1e-7
        grads = engine.full_grads()
        for n, ref in ref_grads.items():
            torch.testing.assert_close(grads[n], ref, rtol=1e-4, atol=1e-6, msg=n)
        engine.zero_grad()
    got = engine.forward(batch.sequences)
    for g, w in zip(got, ref_logps, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)

    # The regression: with flat positions (what GPTModel does with position_ids), sequences
    # on later branches of the tree come out wrong.
    from treetrain.engines.megatron.model import TreeGPT

    real = TreeGPT.forward

    def flat(self: TreeGPT, ids: torch.Tensor | None, tree: object) -> torch.Tensor:
        tree.positions_N = torch.arange(tree.positions_N.shape[0])  # type: ignore[attr-defined]
        return real(self, ids, tree)  # type: ignore[arg-type]

    TreeGPT.forward = flat  # type: ignore[method-assign]
    try:
        wrong = engine.forward(batch.sequences)
    finally:
        TreeGPT.forward = real  # type: ignore[method-assign]
    off = [float((g - w).abs().max()) for g, w in zip(wrong, ref_logps, strict=True)]
    assert sum(d > 1e-3 for d in off) >= 3, off
    engine.forward_backward(batch, loss)
    assert engine.step() > 0


def test_bfloat16_keeps_bf16_weights_and_fp32_master_weights(tmp_path: Path) -> None:
    """``model.dtype: bfloat16``: bf16 parameters and gradients, fp32 master weights in the
    sharded optimizer (a group of one here), fp32 log-probs, and a resume that restores them."""
    from treetrain.engines.zero import ShardedAdamW

    settings = ModelSettings(path=str(save_model("qwen3", tmp_path)), dtype="bfloat16")
    engine = build_engine(settings, "megatron:d1", tree=TREE, optimizer=OptimizerSettings(lr=1e-3))
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert isinstance(engine.optimizer, ShardedAdamW)
    assert {f.master.dtype for f in engine.optimizer.flats if f.master is not None} == {torch.float32}
    batch = make_batch(branching_sequences())
    before = engine.forward(batch.sequences)
    engine.forward_backward(batch, PPOLoss(LossSettings()))
    assert engine.step() > 0
    after = engine.forward(batch.sequences)
    assert all(a.dtype == torch.float32 for a in after)
    assert max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True)) > 0
    engine.save(tmp_path / "ckpt", {})
    masters = [f.master.clone() for f in engine.optimizer.flats if f.master is not None]
    engine.forward_backward(batch, PPOLoss(LossSettings()))
    engine.step()
    engine.load(tmp_path / "ckpt")
    restored = [f.master for f in engine.optimizer.flats if f.master is not None]
    assert all(torch.equal(a, b) for a, b in zip(masters, restored, strict=True))
