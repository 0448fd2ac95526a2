"""Tiny random Llama, Qwen2, Qwen3 and Qwen3-MoE models saved as Hugging Face directories,
and the branching batch the Megatron tests share."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from helpers import backward_alone

COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"intermediate_size": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "qwen2": {"intermediate_size": 128, "tie_word_embeddings": True},
    "qwen3": {"intermediate_size": 128, "head_dim": 16},
    "qwen3_moe": {
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "norm_topk_prob": True,
    },
}


def save_model(family: str, root: Path, seed: int = 0) -> Path:
    """A random model of ``family`` written to ``root / family`` (safetensors + config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / family
    if (path / "config.json").is_file():
        return path
    config = AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms and biases too, so the mapping of every tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def branching_sequences(seed: int = 0, vocab: int = 500, block: int = 16) -> list[list[int]]:
    """Branches at block boundaries and inside blocks, a prefix of another sequence, a
    duplicate, a one-token branch, and one sequence that shares nothing."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(8, vocab) for _ in range(n)]

    system = toks(block)  # branches start exactly at a block boundary
    a = system + toks(2 * block + 3)
    seqs = [
        a,
        system + toks(9),
        a[: 2 * block] + toks(7),  # a branch at the next block boundary
        a[:21] + toks(12),  # inside a block
        a[:30],  # a prefix of a
        list(a),  # a duplicate
        a[:25] + toks(1),  # a one-token branch
        toks(11),  # shares nothing
    ]
    return seqs


def make_batch(seqs: list[list[int]], seed: int = 0) -> Any:
    from treetrain.engines.batch import TokenFields, TrainBatch

    g = torch.Generator().manual_seed(seed)
    masks, adv, old, rets = [], [], [], []
    for s in seqs:
        n = len(s) - 1
        m = torch.zeros(n)
        m[int(torch.randint(0, n, (), generator=g)) :] = 1.0
        masks.append(m)
        adv.append(torch.full((n,), float(torch.randn((), generator=g))))
        old.append(-6.2 + 0.1 * torch.randn(n, generator=g))
        rets.append(torch.rand(n, generator=g))
    return TrainBatch(
        sequences=seqs, loss_mask=masks, fields=TokenFields(advantages=adv, old_logprobs=old, returns=rets)
    )


def reference(path: Path, batch: Any, loss: Any) -> tuple[float, dict[str, torch.Tensor], list[torch.Tensor]]:
    """Each sequence alone through the Hugging Face model: the loss (one global mean), its
    gradients and the per-sequence log-probs."""
    from transformers import AutoModelForCausalLM

    from treetrain.engines.contract import MicroBatchOutput

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    logps: list[torch.Tensor] = []

    def output(seq: list[int]) -> MicroBatchOutput:
        ids = torch.tensor(seq)[None]
        logits = model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), ids[0, 1:]]
        logps.append(logp.detach())
        return MicroBatchOutput(logprobs=logp)

    value = backward_alone(batch, loss, output)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return value, grads, logps


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 keeps a Qwen3-MoE layer's experts fused in memory (``experts.gate_up_proj``
    ``[E, 2f, h]``, ``experts.down_proj`` ``[E, h, f]``); its files, and the engine, name them
    per expert (``experts.{e}.gate_proj.weight``...)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def critic_reference(
    path: Path, batch: Any, loss: Any, head: dict[str, torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor], list[torch.Tensor]]:
    """Each sequence alone through the Hugging Face backbone and the value head ``head``
    (``weight [1, h]``, ``bias [1]``): the value loss (one global mean), its gradients
    (``value_head.weight``/``.bias`` for the head) and the per-sequence values."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from treetrain.engines.contract import MicroBatchOutput

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    w, b = (head[k].detach().clone().requires_grad_(True) for k in ("weight", "bias"))
    values: list[torch.Tensor] = []

    def output(seq: list[int]) -> MicroBatchOutput:
        hidden = model.model(input_ids=torch.tensor(seq)[None]).last_hidden_state[0, :-1]
        v = F.linear(hidden, w, b)[:, 0]
        values.append(v.detach())
        return MicroBatchOutput(values=v)

    value = backward_alone(batch, loss, output)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert w.grad is not None and b.grad is not None
    grads.update({"value_head.weight": w.grad, "value_head.bias": b.grad})
    return value, grads, values


class SumLogprobLoss:
    """Minus the sum of the trained tokens' log-probs: the plainest loss, linear in them."""

    needs_entropy = False

    def __call__(
        self, out: Any, loss_mask: torch.Tensor, inputs: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        total = -(out.logprobs * loss_mask).sum()
        return total, {"logprob_sum": -total.detach()}
