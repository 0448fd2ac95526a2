"""Tiny random Hugging Face models of every family the Archon engine supports, and the
references the Archon tests compare it with (each sequence alone through transformers)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from helpers import backward_alone, spawn_ranks

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
    from treetrain.engines.contract import MicroBatchOutput
    from treetrain.engines.hf_model import build_model

    model = build_model(model_dir, role)

    def output(seq: list[int]) -> MicroBatchOutput:
        ids = torch.tensor(seq)[None]
        if role == "critic":
            return MicroBatchOutput(values=model(input_ids=ids, position_ids=torch.arange(len(seq))[None])[0, :-1])
        logits = model(input_ids=ids).logits[0, :-1].float()
        return MicroBatchOutput(logprobs=torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), ids[0, 1:]])

    value = backward_alone(batch, loss, output)
    grads = [p.grad.double().norm() for p in model.parameters() if p.grad is not None]
    return value, torch.linalg.vector_norm(torch.stack(grads)).float()


def hf_config(family: str) -> Any:
    """The transformers config of ``family``'s tiny model."""
    from transformers import AutoConfig

    fields = copy.deepcopy(FAMILY_CONFIGS[family])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


# The two checks a case runs, by role: actor (model dir, backend, scratch dir), critic (model dir, backend).
Checks = tuple[Callable[[str, str, Path], None], Callable[[str, str], None]]


def run_cases(tmp: str, cases: list[tuple[str, str, str]], checks: Checks) -> None:
    """On one rank: each ``(family, backend, role)`` case through the check of its role, the
    family's model saved under ``tmp`` (the spawned ranks' entry point)."""
    check_actor, check_critic = checks
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
    spawn_ranks(run_cases, 2, str(tmp), cases, (check_actor, check_critic))


def check_tree_and_flat(
    engine: Any,
    batch: Any,
    loss: Any,
    want: tuple[float, torch.Tensor],
    params: Callable[[], Any],
    label: str,
) -> None:
    """Tree-packed and flat, one ``forward_backward`` each: the loss and the gradient norm
    (over ``params()``, summed over pipeline stages) match ``want`` (:func:`hf_reference`)
    within 1e-4 relative."""
    from treetrain.engines.grads import grad_norm

    ref_loss, ref_norm = want
    for use_tree in (True, False):
        stats = engine.forward_backward(batch, loss, tree=use_tree)
        assert abs(stats.loss - ref_loss) <= 1e-4 * abs(ref_loss) + 1e-7, (label, use_tree, stats.loss, ref_loss)
        norm = grad_norm(params(), stages=engine.layout.pp)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=0, msg=f"{label} tree={use_tree}")
        engine.zero_grad()


def check_logprobs(engine: Any, seqs: list[list[int]], want: list[torch.Tensor]) -> None:
    """Tree-packed and flat, ``engine``'s log-probs of ``seqs`` are ``want`` (1e-5 abs)."""
    for use_tree in (True, False):
        for got, ref in zip(engine.forward(seqs, tree=use_tree), want, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def build_critic(model_dir: str, backend: str, tree: dict[str, int]) -> Any:
    """A critic engine on ``model_dir`` (default optimizer), trees of ``tree``'s settings."""
    from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine

    return build_engine(
        ModelSettings(path=model_dir),
        backend,
        role="critic",
        tree=TreeTrainingSettings(**tree),
        optimizer=OptimizerSettings(),
    )
