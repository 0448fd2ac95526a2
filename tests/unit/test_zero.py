"""The sharded (ZeRO-1) AdamW of :mod:`treetrain.engines.zero` and the Megatron engine on it.

- On 2 gloo ranks, :class:`ShardedAdamW` over parameters whose total does not divide by the
  group (padding) takes the same steps as ``torch.optim.AdamW`` on the summed gradients
  (weight decay, clipping through ``scale_grads``), its norm is the summed gradients' norm,
  and its per-rank state is half (plus padding) of AdamW's; bf16 parameters step on an fp32
  master shard and equal fp32 AdamW's parameters rounded to bf16.
- ``megatron:d2`` against ``megatron:d1`` on a tiny Qwen3 with tree-packed branching
  batches: three steps with clipping active give the same losses, gradient norms and
  parameters (fp32, 1e-6), with at most 0.55x the optimizer bytes per rank; a checkpoint
  after step 1 loaded into a fresh engine repeats step 2 exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import spawn_ranks
from megatron_models import branching_sequences, make_batch, save_model

TREE = {"max_tokens_per_mb": 64, "block_size": 16}
STEPS = 3
# Small enough that every step clips (the tiny model's norms are ~1).
OPTIM = {"lr": 1e-3, "weight_decay": 0.01, "max_grad_norm": 0.05}
SHAPES = [(7, 3), (5,), (2, 2, 2)]  # 34 elements: 17 per rank; and 1 more below to pad


pytestmark = pytest.mark.usefixtures("megatron_one_process")


def _sharded_vs_torch() -> None:
    """The pure collective check, on the default group of the spawned ranks."""
    import torch.distributed as dist

    from treetrain.engines.optim import scale_grads
    from treetrain.engines.zero import Bucket, ShardedAdamW, state_bytes

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    shapes = [*SHAPES, (1,)]  # 35 elements: one element of padding
    init = [torch.randn(s) for s in shapes]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt = ShardedAdamW([Bucket([(f"p{i}", p) for i, p in enumerate(mine)], dist.group.WORLD)], **settings)
    want = torch.optim.AdamW(ref, **settings)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1 + rank)  # every rank its own local gradients
    for step in range(STEPS):
        local = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(mine, local, strict=True):
            assert p.grad is not None
            p.grad += g  # autograd accumulates into the buffer's views like this
        summed = [g.clone() for g in local]
        for g in summed:
            dist.all_reduce(g)
        for p, g in zip(ref, summed, strict=True):
            p.grad = g
        opt.reduce_grads()
        norm = float(opt.grad_norm())
        ref_norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in summed])))
        assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (step, norm, ref_norm)
        coef = 0.5 / norm  # clip as Engine.step does, through p.grad
        scale_grads(mine, coef)
        scale_grads(ref, coef)
        opt.step()
        want.step()
        opt.zero_grad()
        for p, q in zip(mine, ref, strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-7, msg=f"step {step}")
            assert p.grad is not None and not p.grad.any()
    # State: 2 x 4 bytes on 18 of the 35 elements, against AdamW's 2 x 4 on all 35.
    assert state_bytes(opt) <= 0.55 * state_bytes(want), (state_bytes(opt), state_bytes(want))
    saved = opt.state_dict()
    fresh = ShardedAdamW([Bucket([(f"p{i}", p) for i, p in enumerate(mine)], dist.group.WORLD)], **settings)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.flats[0].exp_avg, opt.flats[0].exp_avg)
    assert torch.equal(fresh.flats[0].exp_avg_sq, opt.flats[0].exp_avg_sq)
    _bf16_master(settings)


def _bf16_master(settings: dict[str, Any]) -> None:
    """bf16 parameters step on an fp32 master shard: the parameters are the fp32 AdamW's
    parameters rounded to bf16 (gradients whose sums are exact in bf16)."""
    import torch.distributed as dist

    from treetrain.engines.zero import Bucket, ShardedAdamW

    torch.manual_seed(0)
    init = [torch.randn(s).bfloat16().float() for s in SHAPES]
    mine = [torch.nn.Parameter(t.bfloat16()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = ShardedAdamW([Bucket([(f"p{i}", p) for i, p in enumerate(mine)], dist.group.WORLD)], **settings)
    assert opt.flats[0].master is not None and opt.flats[0].master.dtype == torch.float32
    want = torch.optim.AdamW(ref, **settings)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    for step in range(STEPS):
        local = [torch.randint(-8, 9, s, generator=gen) / 4 for s in SHAPES]
        for p, g in zip(mine, local, strict=True):
            assert p.grad is not None
            p.grad += g.bfloat16()
        for q, g in zip(ref, local, strict=True):
            q.grad = g.clone()
            dist.all_reduce(q.grad)
        opt.reduce_grads()
        opt.step()
        want.step()
        for p, q in zip(mine, ref, strict=True):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.detach(), q.detach().bfloat16()), step


def _engine(root: Path, backend: str) -> Any:
    from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine

    model = ModelSettings(path=str(root / "qwen3"))
    return build_engine(model, backend, tree=TreeTrainingSettings(**TREE), optimizer=OptimizerSettings(**OPTIM))


def _train(root: Path, backend: str) -> dict[str, Any]:
    """Three steps of ``backend``; losses, norms, final weights (HF names) and optimizer bytes."""
    import torch.distributed as dist

    from treetrain.config import LossSettings
    from treetrain.engines.megatron.parallel import reset_megatron
    from treetrain.engines.zero import ShardedAdamW, state_bytes
    from treetrain.rl.losses import PPOLoss

    reset_megatron()
    engine = _engine(root, backend)
    assert isinstance(engine.optimizer, ShardedAdamW) == (backend != "megatron:d1"), type(engine.optimizer)
    loss = PPOLoss(LossSettings(clip_eps=0.2))
    batch = make_batch(branching_sequences() + branching_sequences(seed=1))
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.forward_backward(batch, loss).loss)
        norms.append(engine.step())
    weights = engine.hf_weights()
    size = dist.get_world_size()
    every: list[Any] = [None] * size
    dist.all_gather_object(every, state_bytes(engine.optimizer))
    return {"losses": losses, "norms": norms, "weights": weights, "optim_bytes": max(every)}


def _resume(root: Path, backend: str) -> None:
    """Save after step 1, load into a fresh engine: step 2 is the same on both."""
    from treetrain.config import LossSettings
    from treetrain.rl.losses import PPOLoss

    loss = PPOLoss(LossSettings(clip_eps=0.2))
    batch = make_batch(branching_sequences(seed=2) + branching_sequences(seed=3))
    first = _engine(root, backend)
    first.forward_backward(batch, loss)
    first.step()
    first.save(root / "ckpt", {"step": 1})
    fresh = _engine(root, backend)
    assert fresh.load(root / "ckpt") == {"step": 1}
    got = [(e.forward_backward(batch, loss).loss, e.step()) for e in (first, fresh)]
    assert got[0] == got[1], got
    after = [e.forward(batch.sequences) for e in (first, fresh)]
    for a, b in zip(*after, strict=True):
        assert torch.equal(a, b)


def _d2(root: str) -> None:
    import torch.distributed as dist

    _sharded_vs_torch()  # one spawn for both checks (spawning costs more than either)
    result = _train(Path(root), "megatron:d2")
    _resume(Path(root), "megatron:d2")
    if dist.get_rank() == 0:
        torch.save(result, Path(root) / "d2.pt")


@pytest.mark.slow
def test_sharded_adamw_equals_torch_and_d2_equals_d1_with_half_the_state(tmp_path: Path) -> None:
    save_model("qwen3", tmp_path)
    spawn_ranks(_d2, 2, str(tmp_path))
    d2 = torch.load(tmp_path / "d2.pt")
    d1 = _train(tmp_path, "megatron:d1")
    assert all(n > OPTIM["max_grad_norm"] for n in d1["norms"]), d1["norms"]  # clipping active
    for key in ("losses", "norms"):
        for a, b in zip(d2[key], d1[key], strict=True):
            assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (key, d2[key], d1[key])
    assert set(d2["weights"]) == set(d1["weights"])
    for name, want in d1["weights"].items():
        torch.testing.assert_close(d2["weights"][name], want, rtol=0, atol=1e-6, msg=name)
    assert d2["optim_bytes"] <= 0.55 * d1["optim_bytes"], (d2["optim_bytes"], d1["optim_bytes"])
