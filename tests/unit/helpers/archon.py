"""Tiny random Hugging Face models of every family the Archon engine supports, and the
references the Archon tests compare it with (each sequence alone through transformers)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from helpers import spawn_ranks

_BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", **_BASE, "num_attention_heads": 4, "num_key_value_heads": 2},
    # 3 heads (c2 cannot split them) and llama3 RoPE scaling with a short original context.
    "llama3": {
        "model_type": "llama",
        **_BASE,
        "hidden_size": 48,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    "qwen2": {"model_type": "qwen2", **_BASE, "num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen3": {
        "model_type": "qwen3",
        **_BASE,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        **_BASE,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
}
# Branch points at block boundaries (16) and inside blocks, a prefix sequence, a duplicate,
# a one-token branch, and a sequence that shares nothing.
_TRUNK = [(7 * i) % 120 + 3 for i in range(16)]
SEQS = [
    [*_TRUNK, 5, 6, 7, 8, 9],
    [*_TRUNK, 10, 11, 12],
    [*_TRUNK, 10, 11, 12],
    [*_TRUNK[:9], 40, 41, 42, 43, 44, 45],
    _TRUNK[:9],
    [*_TRUNK, 10, 11, 12, 13],
    [*_TRUNK, 99],
    [60, 61, 62, 63, 64, 65, 66],
]


def save_tiny(family: str, path: Path, seed: int = 0) -> Path:
    """A tiny random Hugging Face model of ``family``, saved as a directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)  # large enough for routers and norms to matter
    model.save_pretrained(path)
    return path


def hf_logprobs(model_dir: str | Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence alone through transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor(seq)[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            out.append(logp[torch.arange(len(seq) - 1), ids[0, 1:]])
    return out


def hf_reference(model_dir: str, role: str, batch: Any, loss: Any) -> tuple[float, torch.Tensor]:
    """Each sequence alone through the Hugging Face model: the loss and the gradient norm."""
    from treetrain.engines.base import MicroBatchOutput
    from treetrain.engines.fsdp import build_model

    model = build_model(model_dir, role)
    total = batch.num_loss_tokens()
    value = 0.0
    for i, seq in enumerate(batch.sequences):
        ids = torch.tensor(seq)[None]
        if role == "critic":
            out = MicroBatchOutput(values=model(input_ids=ids, position_ids=torch.arange(len(seq))[None])[0, :-1])
        else:
            logits = model(input_ids=ids).logits[0, :-1].float()
            out = MicroBatchOutput(logprobs=torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), ids[0, 1:]])
        mb_loss, _ = loss(out, batch.loss_mask[i], {k: v[i] for k, v in batch.tensors.items()})
        (mb_loss / total).backward()
        value += float(mb_loss.detach()) / total
    grads = [p.grad.double().norm() for p in model.parameters() if p.grad is not None]
    return value, torch.linalg.vector_norm(torch.stack(grads)).float()


def hf_config(family: str) -> Any:
    """The transformers config of ``family``'s tiny model."""
    from transformers import AutoConfig

    fields = copy.deepcopy(FAMILY_CONFIGS[family])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def run_cases(
    tmp: str,
    cases: list[tuple[str, str, str]],
    check_actor: Callable[[str, str, Path], None],
    check_critic: Callable[[str, str], None],
) -> None:
    """On one rank: each ``(family, backend, role)`` case through the check of its role, the
    family's model saved under ``tmp`` (the spawned ranks' entry point)."""
    for family, backend, role in cases:
        model_dir = str(Path(tmp) / family)
        if role == "critic":
            check_critic(model_dir, backend)
        else:
            check_actor(model_dir, backend, Path(tmp))


def spawn_cases(
    tmp: Path,
    cases: list[tuple[str, str, str]],
    check_actor: Callable[[str, str, Path], None],
    check_critic: Callable[[str, str], None],
) -> None:
    """Save each family's tiny model under ``tmp``, then run ``cases`` on 2 spawned ranks
    (:func:`run_cases`; both checks are module-level functions)."""
    for family in {c[0] for c in cases}:
        save_tiny(family, tmp / family)
    spawn_ranks(run_cases, 2, str(tmp), cases, check_actor, check_critic)
