"""Hugging Face <-> Megatron weights for Llama, Qwen2, Qwen3 and Qwen3-MoE, our own mapping.

Letters: g key/value groups (this rank's), r = heads per group, D head dim, h hidden, f MLP
width, V vocabulary.

Megatron fuses Q, K and V group by group: ``linear_qkv = [q of group 0 (r heads), k0, v0,
q of group 1, ...]`` rows, and tensor parallel splits the groups. ``linear_fc1`` is ``[gate;
up]`` of this rank's MLP columns. ``linear_proj`` and ``linear_fc2`` split their input
dimension, the embedding and the LM head split the vocabulary. Under the TransformerEngine
specs the norms before attention and MLP are fused into the next linear
(``linear_qkv.layer_norm_weight``); the local spec keeps them as ``input_layernorm`` and
``pre_mlp_layernorm``: both names map to the same Hugging Face tensor.

Loading reads only this rank's slices (``safe_open(...).get_slice``): every Megatron tensor
is a concatenation of contiguous row or column ranges of Hugging Face tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from treetrain.engines.errors import EngineConfigError
from treetrain.engines.layout import Layout

# (hf name, dim, index, parts): read part ``index`` of ``parts`` equal pieces along ``dim``.
Read = Callable[[str, int, int, int], torch.Tensor]


class StateDictReader:
    """A :data:`Read` over an in-memory state dict (random built-in models); a directory's
    weights are read by :class:`~treetrain.engines.source.SafetensorsFiles`."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def __call__(self, name: str, dim: int, index: int, parts: int) -> torch.Tensor:
        return self.state[name].float().chunk(parts, dim=dim)[index].clone()


@dataclass(frozen=True, slots=True)
class Shape:
    """What the mapping needs of the model and of this rank."""

    heads: int
    groups: int
    head_dim: int
    hidden: int
    tp: int
    tp_rank: int
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    experts: int = 0

    @property
    def per_group(self) -> int:
        return self.heads // self.groups


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


def _layer_key(name: str, layer_offset: int) -> tuple[str, str]:
    """The Hugging Face prefix of a layer parameter's global layer, and the rest of its name."""
    m = _LAYER.fullmatch(name)
    if m is None:
        raise EngineConfigError(f"no Hugging Face tensor maps to Megatron parameter {name!r}")
    return f"model.layers.{int(m.group(1)) + layer_offset}.", m.group(2)


def load_tensor(name: str, layer_offset: int, read: Read, s: Shape, *, tied: bool) -> torch.Tensor:
    """This rank's value of Megatron parameter ``name`` (a ``TreeGPT.gpt`` name; layer numbers
    are local to the pipeline stage, ``layer_offset`` makes them global)."""
    if name == "embedding.word_embeddings.weight":
        return read("model.embed_tokens.weight", 0, s.tp_rank, s.tp)
    if name == "output_layer.weight":
        return read("model.embed_tokens.weight" if tied else "lm_head.weight", 0, s.tp_rank, s.tp)
    if name == "decoder.final_layernorm.weight":
        return read("model.norm.weight", 0, 0, 1)
    p, rest = _layer_key(name, layer_offset)
    if rest in _NORMS:
        return read(p + _NORMS[rest], 0, 0, 1)
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        g = s.groups // s.tp
        qkv = [read(p + f"self_attn.{x}_proj.{kind}", 0, s.tp_rank, s.tp) for x in "qkv"]
        tail = qkv[0].shape[1:]
        q = qkv[0].reshape(g, s.per_group * s.head_dim, *tail)
        k, v = (t.reshape(g, s.head_dim, *tail) for t in qkv[1:])
        return torch.cat((q, k, v), dim=1).reshape(-1, *tail)
    if rest == "self_attention.linear_proj.weight":
        return read(p + "self_attn.o_proj.weight", 1, s.tp_rank, s.tp)
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([read(p + f"mlp.{x}_proj.weight", 0, s.tp_rank, s.tp) for x in ("gate", "up")])
    if rest == "mlp.linear_fc2.weight":
        return read(p + "mlp.down_proj.weight", 1, s.tp_rank, s.tp)
    if rest == "mlp.router.weight":
        return read(p + "mlp.gate.weight", 0, 0, 1)
    e = _EXPERT.fullmatch(rest)
    if e is not None:
        expert = s.ep_rank * (s.experts // s.ep) + int(e.group(1))
        ex = p + f"mlp.experts.{expert}."
        if e.group(2) == "linear_fc1.weight":
            return torch.cat([read(ex + f"{x}_proj.weight", 0, s.etp_rank, s.etp) for x in ("gate", "up")])
        if e.group(2) == "linear_fc2.weight":
            return read(ex + "down_proj.weight", 1, s.etp_rank, s.etp)
    raise EngineConfigError(f"no Hugging Face tensor maps to Megatron parameter {name!r}")


_TP_SPLIT = (
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)


def tp_split(name: str) -> bool:
    """Whether tensor parallel splits this (dense) parameter; the rest is replicated. Read
    from the mapping, not from megatron's parameter attributes, which it only sets when it
    initialises the weights itself (we load them)."""
    return ".experts." not in name and name.endswith(_TP_SPLIT)


# -- export ---------------------------------------------------------------------------------

# (hf name, dim, index, parts, tensor): one piece of a Hugging Face tensor; rank 0 puts the
# pieces of each name together along dim.
Piece = tuple[str, int, int, int, torch.Tensor]


def export_pieces(name: str, value: torch.Tensor, layer_offset: int, s: Shape, *, tied: bool) -> Iterator[Piece]:
    """The Hugging Face pieces this rank holds of Megatron parameter ``name``: the inverse
    of :func:`load_tensor`."""
    t = value.detach().float().cpu()
    if name == "embedding.word_embeddings.weight":
        yield ("model.embed_tokens.weight", 0, s.tp_rank, s.tp, t)
        return
    if name == "output_layer.weight":
        if not tied:
            yield ("lm_head.weight", 0, s.tp_rank, s.tp, t)
        return
    if name == "decoder.final_layernorm.weight":
        yield ("model.norm.weight", 0, 0, 1, t)
        return
    p, rest = _layer_key(name, layer_offset)
    if rest in _NORMS:
        yield (p + _NORMS[rest], 0, 0, 1, t)
    elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        g = s.groups // s.tp
        tail = t.shape[1:]
        fused = t.reshape(g, s.per_group + 2, s.head_dim, *tail)
        yield (p + f"self_attn.q_proj.{kind}", 0, s.tp_rank, s.tp, fused[:, : s.per_group].reshape(-1, *tail))
        yield (p + f"self_attn.k_proj.{kind}", 0, s.tp_rank, s.tp, fused[:, s.per_group].reshape(-1, *tail))
        yield (p + f"self_attn.v_proj.{kind}", 0, s.tp_rank, s.tp, fused[:, s.per_group + 1].reshape(-1, *tail))
    elif rest == "self_attention.linear_proj.weight":
        yield (p + "self_attn.o_proj.weight", 1, s.tp_rank, s.tp, t)
    elif rest == "mlp.linear_fc1.weight":
        gate, up = t.chunk(2)
        yield (p + "mlp.gate_proj.weight", 0, s.tp_rank, s.tp, gate)
        yield (p + "mlp.up_proj.weight", 0, s.tp_rank, s.tp, up)
    elif rest == "mlp.linear_fc2.weight":
        yield (p + "mlp.down_proj.weight", 1, s.tp_rank, s.tp, t)
    elif rest == "mlp.router.weight":
        yield (p + "mlp.gate.weight", 0, 0, 1, t)
    elif (e := _EXPERT.fullmatch(rest)) is not None:
        q = p + f"mlp.experts.{s.ep_rank * (s.experts // s.ep) + int(e.group(1))}."
        if e.group(2) == "linear_fc1.weight":
            gate, up = t.chunk(2)
            yield (q + "gate_proj.weight", 0, s.etp_rank, s.etp, gate)
            yield (q + "up_proj.weight", 0, s.etp_rank, s.etp, up)
        else:
            yield (q + "down_proj.weight", 1, s.etp_rank, s.etp, t)
    else:
        raise EngineConfigError(f"no Hugging Face tensor for Megatron parameter {name!r}")


def assemble(pieces: list[Piece]) -> dict[str, torch.Tensor]:
    """Full Hugging Face tensors from every rank's pieces (duplicates from replicas are dropped)."""
    by_name: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
    for name, dim, index, _parts, t in pieces:
        by_name.setdefault(name, {})[index] = (dim, t)
    out = {}
    for name, parts in by_name.items():
        dim = parts[0][0]
        out[name] = torch.cat([parts[i][1] for i in sorted(parts)], dim=dim).contiguous()
    return out


def shape_of(hf: Any, layout: Layout) -> Shape:
    """This rank's slice of the model: the tensor and expert sizes and ranks of ``layout``."""
    from treetrain.engines.megatron.config import head_dim

    return Shape(
        heads=hf.num_attention_heads,
        groups=hf.num_key_value_heads,
        head_dim=head_dim(hf),
        hidden=hf.hidden_size,
        tp=layout.tp,
        tp_rank=layout.tp_rank,
        ep=layout.ep,
        ep_rank=layout.rank_in("ep"),
        etp=layout.etp,
        etp_rank=layout.rank_in("etp"),
        experts=int(getattr(hf, "num_experts", 0) or 0),
    )
