"""Gradients of the Megatron engine: which ranks hold copies of each parameter, the sums
that complete them, and the global norm.

Loss scaling divides every micro-batch by the batch's trained-token count, so gradients are
*summed* (not averaged) over the ranks that hold copies of a parameter: data x context ranks
for dense weights, expert-data ranks for experts, tensor ranks for replicated weights that
saw only part of the tokens, and the first and last stage for a tied embedding / head.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from treetrain.config import OptimizerSettings
from treetrain.engines.grads import global_norm
from treetrain.engines.layout import Layout
from treetrain.engines.megatron import convert
from treetrain.engines.megatron.lora import tp_split as lora_tp_split
from treetrain.engines.optim import adamw
from treetrain.engines.zero import Bucket, ShardedAdamW

TIED = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True, slots=True)
class GradPlan:
    """Megatron's grid as the gradient code reads it: the layout's sizes and Megatron's own
    groups (which exist at one rank too: the optimizer's buckets take them)."""

    layout: Layout
    tied: bool  # a tied embedding / head (actor or ref)

    def split_tie(self, name: str) -> bool:
        """Whether ``name`` is one copy of a tied embedding / head split over two stages."""
        return self.layout.pp > 1 and self.tied and name in TIED

    def copies(self, name: str) -> int:
        """How many ranks hold this same parameter (and, after :func:`finalize_grads`, the
        same gradient)."""
        s = self.layout
        if is_expert(name):
            return s.world_size // (s.pp * s.ep * s.etp)
        copies = s.world_size // s.pp
        if convert.tp_split(name) or lora_tp_split(name):
            copies //= s.tp
        if self.split_tie(name):
            copies *= 2
        return copies


def is_expert(name: str) -> bool:
    return ".experts." in name


def tp_partial(name: str, p: torch.Tensor) -> bool:
    """Whether each tensor rank holds only part of this replicated parameter's gradient:
    norms and the router under sequence parallel (a rank saw ``1/t`` of the tokens; Megatron
    marks them ``sequence_parallel``), q/k norms (a rank saw only its heads)."""
    return bool(getattr(p, "sequence_parallel", False)) or "q_layernorm" in name or "k_layernorm" in name


def grad_groups(named: Iterable[tuple[str, torch.Tensor]], plan: GradPlan) -> dict[str, list[torch.Tensor]]:
    """Gradients by the collective that completes them."""
    out: dict[str, list[torch.Tensor]] = {"dp_cp": [], "edp": [], "tp": [], "tied": []}
    for name, p in named:
        if p.grad is None:
            continue
        out["edp" if is_expert(name) else "dp_cp"].append(p.grad)
        if tp_partial(name, p):
            out["tp"].append(p.grad)
        if plan.split_tie(name):
            out["tied"].append(p.grad)
    return out


def finalize_grads(
    named: Iterable[tuple[str, torch.Tensor]], plan: GradPlan, sharded: ShardedAdamW | None = None
) -> None:
    """Sum gradients over the ranks that hold copies of the same parameter. With a
    ``sharded`` optimizer the data-parallel sums are its reduce-scatter (each rank then holds
    its shard summed), after the tensor and tied sums on the whole local gradients."""
    from megatron.core import parallel_state as ps

    if sharded is not None:
        sharded.attach_grads()
    g = grad_groups(named, plan)
    own = plan.layout.group_of
    data = [] if sharded is not None else [("dp_cp", own("dp_cp")), ("edp", own("edp"))]
    steps = [
        *data,
        ("tp", own("tp")),
        ("tied", ps.get_embedding_group() if g["tied"] else None),
    ]
    for key, group in steps:
        if g[key] and group is not None and dist.get_world_size(group) > 1:
            all_reduce_flat(g[key], group)
    if sharded is not None:
        sharded.reduce_grads()


def build_optimizer(
    model: torch.nn.Module,
    named: Sequence[tuple[str, torch.nn.Parameter]],
    plan: GradPlan,
    settings: OptimizerSettings | None,
) -> torch.optim.Optimizer | None:
    """The engine's AdamW: sharded over the data ranks (:class:`ShardedAdamW`, dense weights
    over data x context, experts over expert-data) when either group has more than one rank or
    the weights are 16-bit (its fp32 master weights), else ``torch.optim.AdamW``. ``named``: every trained parameter of ``model`` by Megatron name (LoRA: the adapter's)."""
    dense = [(n, p) for n, p in named if not is_expert(n)]
    experts = [(n, p) for n, p in named if is_expert(n)]
    own = plan.layout.group_of
    wide = [g for g, part in ((own("dp_cp"), dense), (own("edp"), experts)) if part]
    low_precision = any(p.dtype != torch.float32 for _, p in named)  # needs fp32 master weights
    if settings is None or (all(dist.get_world_size(g) == 1 for g in wide) and not low_precision):
        return adamw(model, settings)
    if {id(p) for p in model.parameters() if p.requires_grad} != {id(p) for _, p in named}:
        raise ValueError("the sharded optimizer needs every trained parameter of the model by name")
    return ShardedAdamW(
        [Bucket(dense, own("dp_cp")), Bucket(experts, own("edp"))],
        lr=settings.lr,
        betas=(settings.betas[0], settings.betas[1]),
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        copies=plan.copies,
    )


def grad_norm(named: Iterable[tuple[str, torch.Tensor]], plan: GradPlan, *, device: torch.device) -> torch.Tensor:
    """The global L2 norm of the gradients, in one all-reduce over every rank: each rank
    adds its local sums of squares divided by how many ranks hold that same tensor."""
    return global_norm(((p.grad, plan.copies(name)) for name, p in named if p.grad is not None), device=device)


def all_reduce_flat(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum ``tensors`` over ``group`` in one collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
