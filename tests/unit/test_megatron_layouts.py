"""Megatron layouts that once failed, run as the product runs them (no test-only patch).

- ``megatron:d2c2`` on 4 CPU ranks (a tiny Qwen3): the context-parallel all-gather's backward
  went through torch's gloo all-gather, which scatters from *group* ranks as if they were
  global ones and died on the context group without rank 0 (``Global rank 0 is not part of
  group``). Now: loss, gradients and norm equal each sequence alone through transformers, and
  the sharded optimizer (over the 4 data x context ranks) steps. Our collectives on a group
  without rank 0 are checked directly too.
- ``treetrain train`` with ``megatron:(attn:d2|ffn:e2)`` on a tiny Qwen3-MoE under torchrun
  (2 CPU ranks): megatron-core's MoE router runs on the CPU through the engine's own adapter
  (``parallel.cpu_adapter``) and two tree-packed GRPO steps complete."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import merge, spawn_ranks, step_lines, torchrun
from megatron_models import branching_sequences, make_batch, reference, save_model
from suite_helpers import small

TREE = {"max_tokens_per_mb": 64, "block_size": 16}


def _collectives_without_rank_0() -> None:
    import torch.distributed as dist

    from treetrain.engines.zero import all_gather_flat, reduce_scatter_sum

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    flat = torch.arange(6, dtype=torch.float32) * (rank + 1)
    mine = torch.empty(3)
    reduce_scatter_sum(mine, flat, group)
    both = torch.arange(6, dtype=torch.float32) * (2 * (rank // 2) + 1 + 2 * (rank // 2) + 2)
    assert torch.equal(mine, both.view(2, 3)[rank % 2]), (rank, mine)
    flat.view(2, 3)[rank % 2] = mine  # every rank its own slice, then all of them
    all_gather_flat(flat, group)
    assert torch.equal(flat, both), (rank, flat)


def _d2c2(root: str) -> None:
    from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine
    from treetrain.engines.zero import ShardedAdamW
    from treetrain.rl.losses import PPOLoss

    path = Path(root) / "qwen3"
    loss = PPOLoss(LossSettings(clip_eps=0.2))
    batch = make_batch(branching_sequences() + branching_sequences(seed=1))
    model = ModelSettings(path=str(path))
    engine = build_engine(model, "megatron:d2c2", tree=TreeTrainingSettings(**TREE), optimizer=OptimizerSettings())
    _collectives_without_rank_0()
    assert isinstance(engine.optimizer, ShardedAdamW) and engine.optimizer.flats[0].size == 4
    ref_loss, ref_grads, _ = reference(path, batch, loss)
    ref_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()])))
    stats = engine.forward_backward(batch, loss)
    assert abs(stats.loss - ref_loss) <= 1e-4 * abs(ref_loss) + 1e-7, (stats.loss, ref_loss)
    norm = float(engine.grad_norm())
    assert abs(norm - ref_norm) <= 1e-4 * ref_norm, (norm, ref_norm)
    engine.optimizer.gather_grads()  # each rank summed only its shard: complete them to compare
    grads = engine.full_grads()
    assert set(grads) == set(ref_grads)
    for n, want in ref_grads.items():
        torch.testing.assert_close(grads[n], want, rtol=1e-4, atol=1e-6, msg=n)
    assert engine.step() == pytest.approx(norm, rel=1e-6)
    assert engine.forward_backward(batch, loss).loss != stats.loss  # the step changed the weights


@pytest.mark.slow
def test_d2c2_four_ranks_match_each_sequence_alone(tmp_path: Path) -> None:
    save_model("qwen3", tmp_path)
    spawn_ranks(_d2c2, 4, str(tmp_path))


@pytest.mark.slow
def test_torchrun_megatron_moe_trains_on_cpu(tmp_path: Path) -> None:
    path = save_model("qwen3_moe", tmp_path)
    backend = "megatron:(attn:d2|ffn:e2)"
    raw = merge(small(), {"model": {"path": str(path)}, "actor": {"backend": backend}, "trainer": {"steps": 2}})
    done = torchrun(raw, tmp_path / "c.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert step_lines(done) == ["step 1/2", "step 2/2"], done.stdout[-2000:]
    assert backend in done.stdout and "tree packing on" in done.stdout
    assert "Traceback" not in done.stderr
