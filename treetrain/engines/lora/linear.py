"""A LoRA adapter on a linear layer, for the engines that shard with DTensor (FSDP, Archon).

The linear layer keeps its module, name and weight (so tensor-parallel plans, FSDP2 units
and weight names stay as they are); the adapter is two child modules, ``lora_A`` and
``lora_B`` (each a ``weight``, the names PEFT gives them), and a forward hook that adds
``scale * B A dropout(x)`` to the layer's output. Attached after tensor parallel and before
FSDP2, with the placements of the layer it adapts:

- column-parallel (q/k/v, gate/up: the weight's output rows split over the tensor ranks):
  ``A`` replicated, ``B`` split by rows like the weight. Every rank's ``A`` gradient is a
  part of the whole, which DTensor sums (the hook computes on DTensors).
- row-parallel (o, down: the input columns split): ``A`` split by columns like the weight,
  ``B`` replicated; the ``r``-wide partial sums ``A x`` are reduced with the layer's own
  output layout (an all-reduce, or a reduce-scatter to sequence shards under sequence
  parallel).

The adapter computes in its input's dtype (the compute dtype) from fp32 weights; with
``B = 0`` it adds exact zeros, so a new adapter leaves the base model's outputs unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

Split = Literal["column", "row"]


class LoraWeight(nn.Module):
    """One of an adapter's two matrices (a module, so its parameter is named ``lora_A.weight``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (``...q_proj.lora_A.weight``; an engine's
    own adapter modules are named ``lora``: ``...experts.lora.w1_A``)."""
    return any(part in ("lora_A", "lora_B", "lora") for part in name.split("."))


def attach(
    linear: nn.Module,
    rank: int,
    *,
    scale: float,
    dropout: float,
    split: Split | None = None,
    mesh: DeviceMesh | None = None,
    out_placements: Sequence[Placement] = (),
) -> None:
    """Give ``linear`` (``in -> out``, its weight ``[out, in]`` maybe tensor-parallel over
    ``mesh``) an adapter of rank ``rank``, both matrices zero until the engine loads them (a
    new adapter's values: :func:`treetrain.engines.lora.peft_files.initial`). ``split``: how
    tensor parallel split the layer (None: not split); ``out_placements``: the layout of its
    output on ``mesh`` (the style's ``output_layouts``), which the adapter's output is
    redistributed to."""
    weight = linear.get_parameter("weight")
    out_features, in_features = weight.shape  # the full shape (a DTensor's is the global one)
    device = weight.to_local().device if isinstance(weight, DTensor) else weight.device
    a = torch.zeros((rank, in_features), device=device, dtype=torch.float32)
    b = torch.zeros((out_features, rank), device=device, dtype=torch.float32)
    if split is not None and mesh is not None:
        a_place: list[Placement] = [Shard(1) if split == "row" else Replicate()]
        b_place: list[Placement] = [Shard(0) if split == "column" else Replicate()]
        a = distribute_tensor(a, mesh, a_place, src_data_rank=None)
        b = distribute_tensor(b, mesh, b_place, src_data_rank=None)
    linear.lora_A = LoraWeight(a)
    linear.lora_B = LoraWeight(b)
    hook = functools.partial(_add_update, scale=scale, dropout=dropout, out_placements=tuple(out_placements))
    linear.register_forward_hook(hook)


def _add_update(
    module: nn.Module,
    args: tuple[Any, ...],
    out: torch.Tensor,
    *,
    scale: float,
    dropout: float,
    out_placements: tuple[Placement, ...],
) -> torch.Tensor:
    x = args[0]
    a: Any = module.get_submodule("lora_A").weight
    b: Any = module.get_submodule("lora_B").weight
    if dropout and module.training:
        x = F.dropout(x, dropout, training=True)
    delta = F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * scale
    if isinstance(delta, DTensor):
        if isinstance(out, DTensor):
            delta = delta.redistribute(out.device_mesh, out.placements)
        else:
            delta = delta.redistribute(delta.device_mesh, out_placements or [Replicate()]).to_local()
    result: torch.Tensor = out + delta
    return result


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapter's parameters by name (what the optimizer steps and a checkpoint keeps)."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]


def freeze_base(model: nn.Module) -> None:
    """Every parameter but the adapter's stops requiring a gradient."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
