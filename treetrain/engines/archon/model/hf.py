"""Weights between Hugging Face checkpoints and the Archon models.

Our names (``layers.3.attention.wq.weight``) map to Hugging Face's
(``model.layers.3.self_attn.q_proj.weight``) one to one, except stacked experts: ours are
``[E, ...]`` tensors, a checkpoint on disk has one tensor per expert
(``mlp.experts.7.gate_proj.weight``), and transformers' in-memory Qwen3-MoE fuses gate and up
(``mlp.experts.gate_up_proj``). Reads go through ``safetensors`` directly, one tensor at a
time, memory-mapped: each rank reads only the tensors its pipeline stage holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

_PLAIN = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "moe.router": "mlp.gate",
}
EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)$")
_EXPERT_RE = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])$")


def hf_name(name: str) -> str:
    """The Hugging Face name of one of our (non-expert) parameters."""
    if name in _PLAIN:
        return _PLAIN[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in LAYER_NAMES:
        raise KeyError(f"no Hugging Face name for {name!r}")
    return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def is_expert(name: str) -> bool:
    return _EXPERT_RE.fullmatch(name) is not None


def expert_names(name: str, n_experts: int) -> list[str]:
    m = _EXPERT_RE.fullmatch(name)
    assert m is not None, name
    layer, w = m.groups()
    return [f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_NAMES[w]}.weight" for e in range(n_experts)]


def from_hf(names: Iterable[str], read: Any, *, n_experts: int, tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """Our state dict for ``names`` from ``read(hf_key) -> tensor`` (a :class:`~treetrain.engines.source.SafetensorsFiles`
    or a dict, on disk or in transformers' memory layout)."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name.startswith("value_head."):
            continue  # a critic's head is not in a causal LM checkpoint
        if is_expert(name):
            out[name] = _read_experts(name, read, n_experts)
        elif name == "output.weight" and tie_embeddings and "lm_head.weight" not in read:
            out[name] = read.get("model.embed_tokens.weight")
        else:
            out[name] = read.get(hf_name(name))
    return out


def _read_experts(name: str, read: Any, n_experts: int) -> torch.Tensor:
    per_expert = expert_names(name, n_experts)
    if per_expert[0] in read:
        return torch.stack([read.get(k) for k in per_expert])
    m = _EXPERT_RE.fullmatch(name)
    assert m is not None
    prefix = f"model.layers.{m.group(1)}.mlp.experts."
    if m.group(2) == "w2":
        down: torch.Tensor = read.get(prefix + "down_proj")
        return down
    fused: torch.Tensor = read.get(prefix + "gate_up_proj")  # transformers' [E, 2I, d]
    gate, up = fused.chunk(2, dim=1)
    return gate if m.group(2) == "w1" else up


class _Dict:
    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state

    def __contains__(self, key: str) -> bool:
        return key in self.state

    def get(self, key: str) -> torch.Tensor:
        return self.state[key]


def from_hf_state(
    names: Iterable[str], state: Mapping[str, torch.Tensor], *, n_experts: int, tie_embeddings: bool
) -> dict[str, torch.Tensor]:
    """:func:`from_hf` over an in-memory Hugging Face state dict."""
    return from_hf(names, _Dict(state), n_experts=n_experts, tie_embeddings=tie_embeddings)


def to_hf(state: Mapping[str, torch.Tensor], *, tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """Hugging Face's on-disk names (one tensor per expert) for our full tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith("value_head."):
            continue
        if name == "output.weight" and tie_embeddings:
            continue
        if is_expert(name):
            for key, t in zip(expert_names(name, tensor.shape[0]), tensor.unbind(0), strict=True):
                out[key] = t.contiguous()
        else:
            out[hf_name(name)] = tensor.contiguous()
    return out
