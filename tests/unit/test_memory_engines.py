"""The memory estimator's static parts equal what each engine really holds: parameters,
``.grad`` and optimizer state, counted from the engine's tensors (DTensor local shards) after
a forward-backward and a step, within 2%, for every letter of every engine.

One 2-rank gloo spawn per engine runs its layouts in turn (FSDP d2 and t2, each in fp32 and in
bf16 with its fp32 master weights; Archon d2, t2, c2, p2 and a hybrid MoE with e2, and t2 and p2
in bf16, FSDP2 casting over a one-rank data mesh; Megatron d2, t2, c2, p2, a hybrid MoE with e2,
and d2 in bf16), and one 1-rank spawn runs each engine's d1 in fp32 and in bf16. Every rank is
compared with the estimate of its pipeline stage (the largest rank where FSDP's uneven
shards differ).

LoRA cases (a case's fourth field; in the same spawns) count the frozen base (no ``.grad``, no
optimizer state) and the adapter (fp32, with both) against ``estimate(..., lora=)``: every
engine's d1, d2, t2 in fp32, a bf16 base on d2 (FSDP, Megatron) and t2 (Archon), and Archon's and
Megatron's adapters on experts over e2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import spawn_ranks
from megatron_models import branching_sequences, make_batch, save_model

TREE = {"max_tokens_per_mb": 64, "block_size": 16}
TOLERANCE = 0.02
LORA_RANK = 4
LORA = True  # a case's fourth field: train a LoRA adapter of rank LORA_RANK on every target
Case = tuple[str, str, str] | tuple[str, str, str, bool]
FSDP: list[Case] = [
    ("qwen3", "fsdp:d2", "float32"),
    ("qwen3", "fsdp:d2", "bfloat16"),
    ("qwen3", "fsdp:t2", "float32"),
    ("qwen3", "fsdp:t2", "bfloat16"),  # fp32 masters: FSDP2 over a one-rank data mesh
    ("qwen3", "fsdp:d2", "float32", LORA),
    ("qwen3", "fsdp:d2", "bfloat16", LORA),  # the frozen base in bf16, the adapter fp32
    ("qwen3", "fsdp:t2", "float32", LORA),
]
ARCHON: list[Case] = [
    ("qwen3", "archon:d2", "float32"),
    ("qwen3", "archon:t2", "float32"),
    ("qwen3", "archon:t2", "bfloat16"),
    ("qwen3", "archon:c2", "float32"),
    ("qwen2", "archon:p2", "float32"),  # a tied head: one copy per stage
    ("qwen2", "archon:p2", "bfloat16"),
    ("qwen3_moe", "archon:(attn:d2|ffn:e2)", "float32"),
    ("qwen3", "archon:d2", "float32", LORA),
    ("qwen3", "archon:t2", "float32", LORA),
    ("qwen3", "archon:t2", "bfloat16", LORA),
    ("qwen3_moe", "archon:(attn:d2|ffn:e2)", "float32", LORA),  # an adapter per expert, split over e
]
MEGATRON: list[Case] = [
    ("qwen3", "megatron:d2", "float32"),
    ("qwen3", "megatron:d2", "bfloat16"),  # bf16 weights, fp32 masters in the sharded optimizer
    ("qwen3", "megatron:t2", "float32"),
    ("qwen3", "megatron:c2", "float32"),
    ("qwen2", "megatron:p2", "float32"),
    ("qwen3_moe", "megatron:(attn:d2|ffn:e2)", "float32"),
    ("qwen3", "megatron:d2", "float32", LORA),  # ZeRO-1 over the adapter's state only
    ("qwen3", "megatron:d2", "bfloat16", LORA),
    ("qwen3", "megatron:t2", "float32", LORA),
    ("qwen3_moe", "megatron:(attn:d2|ffn:e2)", "float32", LORA),
]
SINGLE: list[Case] = [
    (family, f"{engine}:d1", dtype)
    for engine in ("fsdp", "archon", "megatron")
    for family, dtype in (("qwen3", "float32"), ("qwen3", "bfloat16"))
]
SINGLE += [("qwen3", f"{engine}:d1", "float32", LORA) for engine in ("fsdp", "archon", "megatron")]


def _bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def held(engine: Any) -> dict[str, int]:
    """Bytes of this rank's parameter tensors, their gradients and optimizer state."""
    params = list(engine.model.parameters())  # a tied head is the embedding: listed once
    grads = sum(_bytes(p.grad) for p in params if p.grad is not None)
    optimizer = 0
    for state in engine.optimizer.state.values():
        optimizer += sum(_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"parameters": sum(_bytes(p) for p in params), "gradients": grads, "optimizer": optimizer}


def _stage(engine: Any, backend: str) -> int:
    if backend.startswith("fsdp"):
        return 0
    if backend.startswith("archon"):
        return int(engine.layout.pp_rank)
    from megatron.core import parallel_state as ps

    return int(ps.get_pipeline_model_parallel_rank())


def _check(family: str, backend: str, dtype: str, root: Path, lora: bool = False) -> None:
    import json

    import torch.distributed as dist

    from treetrain.alloc import parse
    from treetrain.alloc.memory import estimate
    from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.config.lora import LoraSettings
    from treetrain.engines import build_engine
    from treetrain.rl.losses import PPOLoss

    if backend.startswith("megatron"):
        from treetrain.engines.megatron.parallel import reset_megatron

        reset_megatron()
    path = root / family
    model = ModelSettings(path=str(path), dtype=dtype)  # type: ignore[arg-type]
    tree = TreeTrainingSettings(**TREE)
    adapter = LoraSettings(rank=LORA_RANK) if lora else None
    engine = build_engine(model, backend, tree=tree, optimizer=OptimizerSettings(lr=1e-3), lora=adapter)
    batch = make_batch(branching_sequences() + branching_sequences(seed=1))
    engine.forward_backward(batch, PPOLoss(LossSettings(clip_eps=0.2)))
    got = held(engine)
    got_grads = got["gradients"]
    if lora:  # the base frozen: no gradient on it
        frozen = [p for p in engine.model.parameters() if not p.requires_grad]
        assert frozen and all(p.grad is None for p in frozen), backend
    engine.step()
    if lora:  # the optimizer steps (and holds state for) the adapter only
        stepped = [p for group in engine.optimizer.param_groups for p in group["params"]]
        assert engine.optimizer.state and stepped and all(p.requires_grad for p in stepped), backend
    got = {**held(engine), "gradients": got_grads}
    config = json.loads((path / "config.json").read_text())
    shape = adapter.shape() if adapter is not None else None
    plan = estimate(config, parse(backend), tokens=TREE["max_tokens_per_mb"], dtype=dtype, lora=shape)
    world = dist.get_world_size() if dist.is_initialized() else 1
    every: list[Any] = [None] * world
    mine = (_stage(engine, backend), got)
    if world > 1:
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    for stage in {s for s, _ in every}:
        want = plan.ranks[stage].to_dict()
        ranks = [g for s, g in every if s == stage]
        for key in ("parameters", "gradients", "optimizer"):
            largest = max(g[key] for g in ranks)
            why = (backend, dtype, lora, stage, key, largest, want[key])
            assert abs(largest - want[key]) <= TOLERANCE * want[key], why


def _checks(root: str, cases: list[Case]) -> None:
    for family, backend, dtype, *lora in cases:
        _check(family, backend, dtype, Path(root), *lora)


def _spawn(cases: list[Case], world: int, root: Path) -> None:
    for family in {c[0] for c in cases}:
        save_model(family, root)
    spawn_ranks(_checks, world, str(root), cases)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "cases"), [("fsdp", FSDP), ("archon", ARCHON), ("megatron", MEGATRON)], ids=["fsdp", "archon", "megatron"]
)
def test_static_memory_equals_what_two_ranks_hold(name: str, cases: list[Case], tmp_path: Path) -> None:
    _spawn(cases, 2, tmp_path)


@pytest.mark.slow
def test_static_memory_equals_what_one_rank_holds(tmp_path: Path) -> None:
    _spawn(SINGLE, 1, tmp_path)
