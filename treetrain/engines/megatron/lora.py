"""LoRA on the Megatron engine: adapters on megatron-core's linear layers, the base frozen.

Megatron fuses projections that a PEFT adapter keeps apart: ``linear_qkv`` holds q, k and v
group by group (``[q of group 0, k0, v0, q of group 1, ...]`` rows, :mod:`.convert`) and
``linear_fc1`` holds ``[gate; up]``. Each fused projection gets one LoRA pair per Hugging Face
target (``q_proj_A [r, h]``, ``q_proj_B [q rows, r]`` ...), and their updates are laid out
like the fused weight's rows, so the adapter exports as PEFT names it and loads on the
Hugging Face model. A :class:`LinearAdapters` sits on each adapted linear as a child
``lora`` (its parameters: ``...linear_qkv.lora.q_proj_A``) and adds ``scale * B A x`` to the
layer's output through a forward hook:

- column-parallel (``linear_qkv``, ``linear_fc1``; output rows split over the tensor ranks):
  ``A`` replicated, ``B`` split like the weight's rows. The ``r``-wide ``A x`` of this rank's
  sequence shard is all-gathered like the layer's input (sequence parallel: the backward
  reduce-scatters), so ``A``'s gradient is partial per tensor rank: it is marked
  ``sequence_parallel`` and the engine sums it over them, as for the norms.
- row-parallel (``linear_proj``, ``linear_fc2``; input split): ``A`` split along the input,
  ``B`` replicated; the partial ``A x`` is reduce-scattered to sequence shards like the
  layer's output, and ``B`` (which saw ``1/t`` of the tokens) is marked ``sequence_parallel``.
- experts (``mlp.experts.local_experts.<i>``, split over ``e`` by expert; never over an ffn
  ``t`` with LoRA): one pair per local expert, no collective.

The adapter is fp32 and computes in its input's dtype; ``B = 0`` adds exact zeros.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from treetrain.alloc.lora import ATTENTION_TARGETS, FFN_TARGETS
from treetrain.config.lora import LoraSettings
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.lora.linear import freeze_base
from treetrain.engines.megatron.convert import Piece, Shape

# Each adapted linear of a decoder layer, the Hugging Face targets its rows fuse (in order)
# and how tensor parallel splits it.
DENSE = {
    "self_attention.linear_qkv": (("q_proj", "k_proj", "v_proj"), "column"),
    "self_attention.linear_proj": (("o_proj",), "row"),
    "mlp.linear_fc1": (("gate_proj", "up_proj"), "column"),
    "mlp.linear_fc2": (("down_proj",), "row"),
}
EXPERT = {"linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
_HF = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
_PARAM = re.compile(r"decoder\.layers\.(\d+)\.(?:mlp\.experts\.local_experts\.(\d+)\.)?(.+)\.lora\.(\w+_proj)_([AB])")


class LinearAdapters(nn.Module):
    """The LoRA pairs of one megatron-core linear (one per fused target it adapts).
    ``rows``: every fused part's rows on this rank (absent targets add zeros) in the fused
    order; ``groups``: the fused layout's interleaving (``linear_qkv``'s local query groups,
    else 1); ``split``: ``column``, ``row`` or None (not split: one tensor rank, or experts)."""

    def __init__(
        self,
        parts: dict[str, tuple[int, int]],
        rows: tuple[tuple[str, int], ...],
        *,
        groups: int,
        split: str | None,
        lora: LoraSettings,
        sequence_parallel: bool,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.rows, self.groups, self.split, self.sequence_parallel = rows, groups, split, sequence_parallel
        self.scale, self.dropout, self.rank = lora.scale, lora.dropout, lora.rank
        self.targets = tuple(parts)
        for target, (n_in, n_out) in parts.items():
            a = nn.Parameter(torch.zeros((lora.rank, n_in), device=device))
            b = nn.Parameter(torch.zeros((n_out, lora.rank), device=device))
            # Partial per tensor rank (each saw its sequence shard): summed over them like a norm.
            partial = a if split == "column" else b if split == "row" else None
            if partial is not None and sequence_parallel:
                partial.sequence_parallel = True  # type: ignore[attr-defined]
            self.register_parameter(f"{target}_A", a)
            self.register_parameter(f"{target}_B", b)

    def pair(self, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_parameter(f"{target}_A"), self.get_parameter(f"{target}_B")

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, training=True) if self.dropout and self.training else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as mtp

        dtype = x.dtype
        # Each target's A x (its own dropout, as PEFT's separate modules), r wide.
        h = torch.cat([F.linear(self._drop(x), self.pair(t)[0].to(dtype)) for t in self.targets], dim=-1)
        if self.split == "column":  # every rank needs every token's A x: gathered like the layer's input
            sp = self.sequence_parallel
            h = mtp.gather_from_sequence_parallel_region(h) if sp else mtp.copy_to_tensor_model_parallel_region(h)
        elif self.split == "row":  # partial sums over the input split: reduced like the layer's output
            sp = self.sequence_parallel
            h = (
                mtp.reduce_scatter_to_sequence_parallel_region(h)
                if sp
                else mtp.reduce_from_tensor_model_parallel_region(h)
            )
        updates = dict(zip(self.targets, h.chunk(len(self.targets), dim=-1), strict=True))
        lead = h.shape[:-1]
        pieces = []
        for target, n in self.rows:
            if target in updates:
                d = F.linear(updates[target], self.pair(target)[1].to(dtype))
            else:
                d = h.new_zeros((*lead, n))
            pieces.append(d.reshape(*lead, self.groups, n // self.groups))
        return torch.cat(pieces, dim=-1).reshape(*lead, -1) * self.scale


def _add_update(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    """Forward hook: megatron's linears return ``(output, bias)``."""
    delta = module.get_submodule("lora")(args[0])
    return (out[0] + delta, *out[1:])


def _attach(linear: nn.Module, adapters: LinearAdapters) -> None:
    linear.lora = adapters
    linear.register_forward_hook(_add_update)


def _sizes(s: Shape, ffn: int) -> dict[str, tuple[int, int]]:
    """Each target's full ``(in, out)`` features (``ffn``: the dense or an expert's width)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.groups * s.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, ffn),
        "up_proj": (h, ffn),
        "down_proj": (ffn, h),
    }


def apply_lora(gpt: Any, lora: LoraSettings, targets: tuple[str, ...], shape: Shape, hf: Any) -> None:
    """Zero adapters on every targeted linear of this stage (the engine loads their values)
    and the base frozen. ``shape``: this rank's slice of the model (:func:`.convert.shape_of`)."""
    config = gpt.config
    tp = shape.tp
    if shape.etp > 1 and shape.experts and set(targets) & set(FFN_TARGETS):
        raise EngineConfigError(
            f"actor.lora: adapters on experts split by an ffn t{shape.etp} are not built; fix: drop the ffn t, "
            f"or target only {', '.join(ATTENTION_TARGETS)}"
        )
    device = next(gpt.parameters()).device
    sizes = _sizes(shape, int(hf.intermediate_size))
    for layer in gpt.decoder.layers:
        for where, (fused, split) in DENSE.items():
            try:
                linear = layer.get_submodule(where)
            except AttributeError:
                continue  # a MoE layer's FFN: its experts below
            chosen = [t for t in fused if t in targets]
            if not chosen:
                continue
            split_by = split if tp > 1 else None
            parts = {}
            for t in chosen:  # this rank's A [r, in] and B [out, r]
                n_in, n_out = sizes[t]
                parts[t] = (n_in // tp, n_out) if split == "row" else (n_in, n_out // tp)
            local_rows = (
                tuple((t, sizes[t][1] // tp) for t in fused) if split == "column" else ((fused[0], shape.hidden),)
            )
            groups = shape.groups // tp if where.endswith("linear_qkv") else 1
            _attach(
                linear,
                LinearAdapters(
                    parts,
                    local_rows,
                    groups=groups,
                    split=split_by,
                    lora=lora,
                    sequence_parallel=bool(config.sequence_parallel),
                    device=device,
                ),
            )
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        esizes = _sizes(shape, int(hf.moe_intermediate_size))
        for expert in experts.local_experts:
            for where, fused in EXPERT.items():
                chosen = [t for t in fused if t in targets]
                if chosen:
                    parts = {t: esizes[t] for t in chosen}
                    rows = tuple((t, esizes[t][1]) for t in fused)
                    adapters = LinearAdapters(
                        parts, rows, groups=1, split=None, lora=lora, sequence_parallel=False, device=device
                    )
                    _attach(expert.get_submodule(where), adapters)
    freeze_base(gpt)


def tp_split(name: str) -> bool:
    """Whether tensor parallel splits this adapter parameter (a column-parallel ``B``, a
    row-parallel ``A``; never an expert's)."""
    m = _PARAM.fullmatch(name)
    if m is None or m.group(2) is not None:
        return False
    split = DENSE[m.group(3)][1]
    return (split == "column" and m.group(5) == "B") or (split == "row" and m.group(5) == "A")


def _slot(name: str, offset: int, s: Shape) -> tuple[str, str, int, int, int]:
    """Where this rank's adapter parameter ``name`` sits in the full adapter: the Hugging Face
    module, ``A`` or ``B``, and its part (``dim``, ``index`` of ``parts``)."""
    m = _PARAM.fullmatch(name)
    if m is None:
        raise EngineConfigError(f"{name!r} is not a Megatron adapter parameter")
    layer, expert, _where, target, which = m.groups()
    prefix = f"model.layers.{int(layer) + offset}."
    if expert is not None:
        global_expert = s.ep_rank * (s.experts // s.ep) + int(expert)
        return f"{prefix}mlp.experts.{global_expert}.{target}", which, 0, 0, 1
    module = prefix + _HF[target]
    if not tp_split(name):
        return module, which, 0, 0, 1
    return module, which, (1 if which == "A" else 0), s.tp_rank, s.tp


def adapter_params(gpt: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's adapter parameters by name, in the same order on every rank."""
    for name, p in gpt.named_parameters():
        if ".lora." in name:
            yield name, p


def pieces(gpt: nn.Module, offset: int, s: Shape, *, dense: bool, grads: bool) -> list[Piece]:
    """This rank's pieces of the full adapter (or of its gradients, zeros where none), named
    ``<module>.lora_A`` / ``.lora_B``; ``dense``: this rank gives the non-expert ones too."""
    out: list[Piece] = []
    for name, p in adapter_params(gpt):
        module, which, dim, index, parts = _slot(name, offset, s)
        if not dense and ".experts." not in name:
            continue
        t = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p
        out.append((f"{module}.lora_{which}", dim, index, parts, t.detach().float().cpu().clone()))
    return out


def load(gpt: nn.Module, adapter: dict[str, tuple[torch.Tensor, torch.Tensor]], offset: int, s: Shape) -> None:
    """This rank's slices of a full adapter (by Hugging Face module) into its parameters."""
    with torch.no_grad():
        for name, p in adapter_params(gpt):
            module, which, dim, index, parts = _slot(name, offset, s)
            full = adapter[module]["AB".index(which)]
            p.copy_(full.chunk(parts, dim=dim)[index])


def hf_modules(hf: Any, targets: tuple[str, ...], s: Shape) -> dict[str, tuple[int, int]]:
    """Every adapted Hugging Face module of the whole model (an expert's one by one) and its
    ``(in, out)`` features."""
    moe = s.experts > 0
    sizes = _sizes(s, int(hf.moe_intermediate_size if moe else hf.intermediate_size))
    out: dict[str, tuple[int, int]] = {}
    for i in range(int(hf.num_hidden_layers)):
        for t in targets:
            if moe and t not in ATTENTION_TARGETS:
                out |= {f"model.layers.{i}.mlp.experts.{e}.{t}": sizes[t] for e in range(s.experts)}
            else:
                out[f"model.layers.{i}.{_HF[t]}"] = sizes[t]
    return out
