"""LoRA on the Archon models: adapters on the dense projections
(:func:`treetrain.engines.lora.linear.attach`, after tensor parallel: column-parallel
``wq``/``wk``/``wv``/``w1``/``w3``, row-parallel ``wo``/``w2`` reduce-scattered to sequence
shards like the layer) and on the experts' stacked weights
(:class:`~treetrain.engines.archon.model.model.ExpertAdapters`, split over ``e`` by expert as
the weights are), the base frozen; and the names between our parameters and a PEFT adapter.

Letters: E experts, r rank, d model width, I FFN width.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from treetrain.alloc.lora import ROW_PARALLEL
from treetrain.config.lora import LoraSettings
from treetrain.engines.archon.layout import ArchonLayout
from treetrain.engines.archon.model import GroupedExperts, ModelArgs, MoE, Transformer
from treetrain.engines.archon.model.hf import EXPERT_NAMES, LAYER_NAMES, hf_name
from treetrain.engines.archon.model.model import ExpertAdapters
from treetrain.engines.lora import Adapter
from treetrain.engines.lora.linear import attach, freeze_base

# Each target's module in a block (dense FFN) and its stacked expert weight (MoE layer).
# LoRA's target names (Hugging Face's) -> our module paths, from the checkpoint name tables.
DENSE = {hf.rsplit(".", 1)[1]: ours for ours, hf in LAYER_NAMES.items() if hf.endswith("_proj")}
EXPERT = {hf: ours for ours, hf in EXPERT_NAMES.items()}
_EXPERT_PARAM = re.compile(r"layers\.(\d+)\.moe\.experts\.lora\.(w[123])_([AB])$")


def apply_lora(model: Transformer, layout: ArchonLayout, lora: LoraSettings, targets: tuple[str, ...]) -> None:
    """Attach zero adapters to this stage's blocks and freeze the base (the engine loads the
    adapter's values)."""
    tp = layout.mesh["tp"] if layout.mesh is not None and layout.tp > 1 else None
    for block in model.layers.values():
        moe = getattr(block, "moe", None)
        for target in targets:
            if target in EXPERT and isinstance(moe, MoE):
                continue
            row = target in ROW_PARALLEL
            attach(
                block.get_submodule(DENSE[target]),
                lora.rank,
                scale=lora.scale,
                dropout=lora.dropout,
                split=None if tp is None else ("row" if row else "column"),
                mesh=tp,
                out_placements=(Shard(0),) if row else (Shard(-1),),
            )
        experts = [EXPERT[t] for t in targets if t in EXPERT]
        if isinstance(moe, MoE) and experts:
            _attach_experts(moe.experts, tuple(experts), lora, layout)
    freeze_base(model)


def _attach_experts(group: GroupedExperts, names: tuple[str, ...], lora: LoraSettings, layout: ArchonLayout) -> None:
    weights = {n: group.get_parameter(n) for n in names}
    local = next(iter(weights.values()))
    device = local.to_local().device if hasattr(local, "to_local") else local.device
    with torch.device(device):
        adapters = ExpertAdapters(names, {n: tuple(w.shape) for n, w in weights.items()}, lora.rank)  # type: ignore[misc]
    adapters.scale, adapters.dropout = lora.scale, lora.dropout
    if layout.experts is not None:  # split by expert like the weights (an ffn t is refused with LoRA)
        mesh = layout.experts["ep", "etp"]
        for name, p in list(adapters.named_parameters()):
            dt = distribute_tensor(p.data, mesh, (Shard(0), Replicate()), src_data_rank=None)
            adapters.register_parameter(name, nn.Parameter(dt))
    group.lora = adapters


def fsdp_placement(name: str) -> Shard:
    """FSDP2's dimension for an expert adapter over the expert-data ranks: ``A``/``B`` of
    ``w1``/``w3`` (``[E, r, d]``, ``[E, I, r]``) their last, of ``w2`` (``[E, r, I]``,
    ``[E, d, r]``) their middle one (never the experts' dimension, which ``e`` splits)."""
    return Shard(2) if name.startswith(("w1", "w3")) else Shard(1)


def hf_modules(args: ModelArgs, targets: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Every adapted Hugging Face module of the whole model (an expert's one by one) and its
    ``(in, out)`` features."""
    d, q, kv = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    out: dict[str, tuple[int, int]] = {}
    for i in range(args.n_layers):
        moe = i in args.moe_layers
        ffn = args.moe_ffn_dim if moe else args.ffn_dim
        sizes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d)}
        sizes |= {"gate_proj": (d, ffn), "up_proj": (d, ffn), "down_proj": (ffn, d)}
        for t in targets:
            if moe and t in EXPERT:
                out |= {f"model.layers.{i}.mlp.experts.{e}.{t}": sizes[t] for e in range(args.n_experts)}
            else:
                out[hf_name(f"layers.{i}.{DENSE[t]}.weight").removesuffix(".weight")] = sizes[t]
    return out


_TARGET_OF = {v: k for k, v in EXPERT.items()}


def to_adapter(full: Mapping[str, torch.Tensor]) -> Adapter:
    """Our full adapter tensors (every stage's) by Hugging Face module, experts one by one."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in full.items():
        m = _EXPERT_PARAM.fullmatch(name)
        if m is not None:
            layer, w, which = m.groups()
            for e, part in enumerate(t.unbind(0)):
                pairs.setdefault(f"model.layers.{layer}.mlp.experts.{e}.{_TARGET_OF[w]}", {})[which] = part
        elif name.endswith((".lora_A.weight", ".lora_B.weight")):
            module, which = name[: -len(".lora_A.weight")], name[-len("A.weight")]
            pairs.setdefault(hf_name(f"{module}.weight").removesuffix(".weight"), {})[which] = t
    return {m: (ab["A"], ab["B"]) for m, ab in pairs.items()}


def from_adapter(adapter: Adapter, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The full tensors of our adapter parameters ``names`` (this stage's) from a PEFT adapter."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        m = _EXPERT_PARAM.fullmatch(name)
        if m is not None:
            layer, w, which = m.groups()
            prefix = f"model.layers.{layer}.mlp.experts."
            count = sum(1 for k in adapter if k.startswith(prefix) and k.endswith(f".{_TARGET_OF[w]}"))
            out[name] = torch.stack([adapter[f"{prefix}{e}.{_TARGET_OF[w]}"]["AB".index(which)] for e in range(count)])
        else:
            module, which = name[: -len(".lora_A.weight")], name[-len("A.weight")]
            out[name] = adapter[hf_name(f"{module}.weight").removesuffix(".weight")]["AB".index(which)]
    return out
