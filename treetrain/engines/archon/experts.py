"""Archon's expert parallel: experts sharded over ``e`` by expert and over the ffn ``t`` by
width, tokens sent to their experts' ranks and back by all-to-all (:class:`ExpertDispatch`),
and the refusals that keep the expert grid whole (:func:`check_ep`).

Letters: E experts (L = E / ep on one rank), T token-expert rows a rank routes, G = ep * etp
ranks of one expert group, S rows it sends, R rows it receives, h model width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from treetrain.alloc import ParallelDims
from treetrain.engines.archon.model import GroupedExperts, ModelArgs, MoE, Transformer
from treetrain.engines.errors import EngineConfigError


def check_ep(args: ModelArgs, dims: ParallelDims) -> None:
    """``e`` must divide the experts and the ffn ``t`` their FFN width; a dense model has no
    experts to shard."""
    ep, etp = dims.ep, dims.etp
    if not args.is_moe:
        dense = "".join(f"{k}{v}" for k, v in (("d", dims.dp), ("t", dims.tp), ("c", dims.cp), ("p", dims.pp)) if v > 1)
        raise EngineConfigError(
            f"e{ep} (ffn t{etp}) shards experts, but this {args.family} model has none; "
            f"fix: drop the experts' letters, e.g. archon:{dense or 'd1'}"
        )
    if args.n_experts % ep:
        fits = [e for e in range(1, args.n_experts + 1) if args.n_experts % e == 0]
        raise EngineConfigError(
            f"e{ep} must divide the experts ({args.n_experts}); fix: e in {{{', '.join(map(str, fits))}}}"
        )
    if args.moe_ffn_dim % etp:
        fits = [t for t in range(1, min(args.moe_ffn_dim, 64) + 1) if args.moe_ffn_dim % t == 0]
        raise EngineConfigError(
            f"ffn t{etp} must divide the expert FFN width ({args.moe_ffn_dim}); "
            f"fix: ffn t in {{{', '.join(map(str, fits))}}}"
        )


class _AllToAllV(torch.autograd.Function):
    """Rows ``x [S, ...]``: the first ``send[0]`` go to group rank 0, the next ``send[1]`` to
    rank 1, ...; returns the ``recv[r]`` rows each rank ``r`` sent us, in rank order. The
    backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


@dataclass(frozen=True, slots=True)
class _Route:
    """One call's routing, kept from the dispatch to the combine."""

    rows_S: torch.Tensor  # the input row of each row sent (each goes to etp ranks)
    send: list[int]
    recv: list[int]
    order_R: torch.Tensor  # received rows (by source rank) -> sorted by local expert
    rows_in: int


class ExpertDispatch:
    """Token dispatch for one ``GroupedExperts`` sharded over an expert group of G = ep * etp
    ranks (row-major: group rank ``g`` holds experts ``[s L, (s + 1) L)``, s = g // etp, and
    the ``g % etp``-th slice of their FFN width).

    Before the experts (a forward pre-hook): the rows of slot ``s``'s experts (contiguous, as
    they arrive sorted by expert) go to each of its etp ranks; one all-to-all of token counts
    per (rank, local expert) gives every rank its split sizes, a second moves the hidden
    states, and the received rows are sorted by local expert. After the experts (a forward
    hook): the reverse exchange, and each row's etp partial outputs (row-parallel ``w2``) are
    summed where the row came from. Both exchanges are differentiable."""

    def __init__(self, group: dist.ProcessGroup, *, ep: int, etp: int, n_experts: int) -> None:
        self.group, self.ep, self.etp, self.local = group, ep, etp, n_experts // ep
        self._routes: list[_Route] = []  # a stack: checkpointing replays dispatch-combine pairs

    def dispatch(self, module: nn.Module, args: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x_Td, counts_E = args
        device, g = x_Td.device, self.ep * self.etp
        counts_sL = counts_E.view(self.ep, self.local)  # by expert slot (ep rank), then local expert
        counts_GL = counts_sL.repeat_interleave(self.etp, dim=0)  # what we send each group rank
        got_GL = torch.empty_like(counts_GL)
        dist.all_to_all_single(got_GL, counts_GL, group=self.group)  # the token-count exchange
        send_G, recv_G = counts_GL.sum(1), got_GL.sum(1)
        sizes = torch.cat([send_G, recv_G]).tolist()  # host sync: the split sizes
        send, recv = sizes[:g], sizes[g:]
        # Rank g gets slot g // etp's rows: a contiguous range of the expert-sorted input.
        start_G = _offsets(counts_sL.sum(1)).repeat_interleave(self.etp)
        rows_S = torch.repeat_interleave(start_G - _offsets(send_G), send_G) + torch.arange(sum(send), device=device)
        got_Rd: torch.Tensor = _AllToAllV.apply(x_Td[rows_S], send, recv, self.group)
        expert_R = torch.repeat_interleave(
            torch.arange(self.local, device=device).repeat(g), got_GL.flatten()
        )  # the local expert of each received row, rows grouped by source rank
        order_R = torch.argsort(expert_R, stable=True)
        self._routes.append(_Route(rows_S=rows_S, send=send, recv=recv, order_R=order_R, rows_in=x_Td.shape[0]))
        return got_Rd[order_R], got_GL.sum(0)

    def combine(self, module: nn.Module, args: Any, out_Rd: torch.Tensor) -> torch.Tensor:
        route = self._routes.pop()
        by_source_Rd = torch.empty_like(out_Rd).index_copy(0, route.order_R, out_Rd)
        back_Sd: torch.Tensor = _AllToAllV.apply(by_source_Rd, route.recv, route.send, self.group)
        out_Td = back_Sd.new_zeros((route.rows_in, *back_Sd.shape[1:]))
        return out_Td.index_add(0, route.rows_S, back_Sd)  # sums a row's etp partial outputs


def _offsets(sizes: torch.Tensor) -> torch.Tensor:
    # Exclusive prefix sums: where each part starts in their concatenation.
    return sizes.cumsum(0) - sizes


def apply_ep(model: Transformer, experts: DeviceMesh) -> None:
    """Shard every MoE layer's experts over the ``(ep, etp)`` ranks of ``experts`` (the mesh
    ``(pp, edp, ep, etp)``): ``w1``/``w3`` ``[E, I, d]`` by expert and FFN width, ``w2``
    ``[E, d, I]`` likewise, as DTensors (so checkpoints and exports see whole tensors), and
    move tokens with :class:`ExpertDispatch`. FSDP2 then shards them over ``edp``."""
    mesh = experts["ep", "etp"]
    ep, etp = mesh.size(0), mesh.size(1)
    placements = {"w1": (Shard(0), Shard(1)), "w3": (Shard(0), Shard(1)), "w2": (Shard(0), Shard(2))}
    group = mesh._flatten("ep_etp").get_group() if ep * etp > 1 else None
    for block in model.layers.values():
        moe = getattr(block, "moe", None)
        if not isinstance(moe, MoE):
            continue  # a dense layer (or a Qwen3-MoE mlp_only layer)
        assert isinstance(moe.experts, GroupedExperts)
        for name, place in placements.items():
            w = getattr(moe.experts, name)
            moe.experts.register_parameter(
                name, nn.Parameter(distribute_tensor(w.data, mesh, place, src_data_rank=None), w.requires_grad)
            )
        if group is not None:
            route = ExpertDispatch(group, ep=ep, etp=etp, n_experts=moe.n_experts)
            moe.experts.register_forward_pre_hook(route.dispatch)
            moe.experts.register_forward_hook(route.combine)
