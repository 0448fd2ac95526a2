"""How an Archon model is spread over the ranks: small ``apply_*`` functions, applied by
:func:`parallelize` in a fixed order (tensor, expert, context parallel, activation
checkpointing, compile, FSDP2). The model code knows none of it.

Letters: N tree tokens (n = N / c on one context rank), H query heads, K key/value heads,
D head dim, c context-parallel size; for experts: E experts (L = E / ep on one rank), T
token-expert rows a rank routes, G = ep * etp ranks of one expert group, S rows it sends,
R rows it receives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from treetrain.alloc import ParallelDims
from treetrain.alloc.precision import Precision
from treetrain.attention import TreeAttentionMeta
from treetrain.engines.archon.layout import ArchonLayout
from treetrain.engines.archon.model import Attention, GroupedExperts, ModelArgs, MoE, Transformer, TreeAttention
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.parallel import one_rank_mesh
from treetrain.engines.precision import mixed_precision


def parallelize(model: Transformer, layout: ArchonLayout, prec: Precision, *, checkpointing: bool) -> Transformer:
    """Apply the strategy in place. Tensor parallel goes first so that FSDP then shards the
    already tensor-parallel parameters (2-D); context parallel only swaps attention cores;
    checkpointing and compile wrap whole blocks before FSDP wraps them once more. FSDP2 wraps
    the model when ``prec.fsdp`` (data x context ranks > 1, or 16-bit compute over fp32
    master weights: then over a one-rank mesh when nothing is sharded)."""
    if layout.mesh is not None and layout.tp > 1:
        apply_tp(model, layout.mesh["tp"])
    if layout.experts is not None:
        apply_ep(model, layout.experts)
    if layout.cp > 1:
        apply_cp(model, layout.group("cp"), layout.cp)
    if checkpointing:
        apply_ac(model)
    if layout.device.type == "cuda":
        apply_compile(model)
    if prec.fsdp:
        mesh = layout.mesh["dp_cp"] if layout.mesh is not None else one_rank_mesh(layout.device, "dp_cp")
        apply_fsdp(model, mesh, mixed_precision(prec), experts=layout.experts)
    return model


# -- tensor parallel -------------------------------------------------------------------------


def check_tp(args: ModelArgs, tp: int) -> None:
    if args.is_moe:
        raise EngineConfigError(
            f"t{tp} on a mixture-of-experts model is not built in the archon engine; "
            "fix: shard experts with e (e.g. archon:(attn:d2|ffn:e2)) and raise d instead of t"
        )
    sizes = (args.n_heads, args.n_kv_heads, args.ffn_dim)
    if any(s % tp for s in sizes):
        fits = [t for t in range(1, args.n_kv_heads + 1) if not any(s % t for s in sizes)]
        raise EngineConfigError(
            f"t{tp} must divide the attention heads ({args.n_heads}), key/value heads ({args.n_kv_heads}) "
            f"and FFN width ({args.ffn_dim}); fix: t in {{{', '.join(map(str, fits))}}}"
        )


def apply_tp(model: Transformer, mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallel with sequence parallel over the tree's tokens (dim 0).

    Between blocks the residual stream is sharded by tokens (``Shard(0)``): norms run on a
    rank's own tokens; attention and FFN inputs are all-gathered, their column-parallel
    projections keep each rank's heads / FFN slice, and the row-parallel outputs are
    reduce-scattered back to token shards. The tree mask needs every token of the tree,
    which the all-gather before attention provides.
    """
    check_tp(model.args, mesh.size())
    emb, head = model.tok_embeddings, model.output
    tied = emb is not None and head is not None and head.weight is emb.weight
    top: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "norm": SequenceParallel(sequence_dim=0),
    }
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(0), output_layouts=Replicate())
    if model.value_head is not None:
        # One output feature: nothing to split. Replicate its weights and gather the tokens.
        distribute_module(model.value_head, mesh)
        top["value_head"] = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))
    parallelize_module(model, mesh, {k: v for k, v in top.items() if getattr(model, k) is not None})
    if tied and emb is not None and head is not None:
        # Each style swapped in its own sharded copy, which cuts the tie: each copy would get
        # only its own use's gradient and the two would drift apart. Both shard the vocabulary
        # rows over the tensor ranks (Shard(0)), so one parameter serves both again.
        head.weight = emb.weight
    for block in model.layers.values():
        plan: dict[str, Any] = {
            "attention_norm": SequenceParallel(sequence_dim=0),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(0), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(0)),
            "ffn_norm": SequenceParallel(sequence_dim=0),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(0)),
            "feed_forward.w3": ColwiseParallel(),
        }
        if model.args.qk_norm:
            # Qwen3's per-head q/k norms see only this rank's heads ([N, H/t, D]): replicated
            # weights over head-sharded inputs, so their gradients are summed over the tensor
            # ranks. As plain tensors each rank would step on its own heads' part and the
            # copies would drift apart (a checkpoint keeps one, so a resume changed the model).
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        parallelize_module(block, mesh, plan)


# -- expert parallel -------------------------------------------------------------------------


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


# -- context parallel ------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """``x [c, ...]``: part ``r`` goes to rank ``r``; returns what each rank sent us, in rank
    order. Its own inverse, so the backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # before empty_like, which would copy a permuted layout's strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's ``x`` along dim 0; the backward sums the gradients of all
    ranks and keeps this rank's rows (an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.rows = group, dist.get_rank(group), x.shape[0]
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None


class UlyssesAttention(nn.Module):
    """Context parallel for trees, heads exchanged (DeepSpeed-Ulysses): each rank holds n = N / c
    consecutive tokens of every head; one all-to-all gives it all N tokens of H / c heads, the
    tree attention runs on whole trees, and one all-to-all brings the rows back. Key/value heads
    that ``c`` does not divide are repeated to the query heads first."""

    def __init__(self, group: dist.ProcessGroup, size: int) -> None:
        super().__init__()
        self.group, self.size = group, size
        self.core = TreeAttention()

    def _to_heads(self, x_HnD: torch.Tensor) -> torch.Tensor:
        h, n, d = x_HnD.shape
        c = self.size
        got_cHnD: torch.Tensor = _AllToAll.apply(
            x_HnD.reshape(c, h // c, n, d), self.group
        )  # [rank r's tokens, my heads]
        return got_cHnD.permute(1, 0, 2, 3).reshape(h // c, c * n, d)

    def _to_rows(self, o_HND: torch.Tensor) -> torch.Tensor:
        h, big_n, d = o_HND.shape
        c = self.size
        parts_cHnD = o_HND.reshape(h, c, big_n // c, d).permute(1, 0, 2, 3)
        got_cHnD: torch.Tensor = _AllToAll.apply(parts_cHnD, self.group)  # [head group r, my tokens]
        return got_cHnD.reshape(c * h, big_n // c, d)

    def forward(
        self, q_HnD: torch.Tensor, k_KnD: torch.Tensor, v_KnD: torch.Tensor, tree: TreeAttentionMeta, scale: float
    ) -> torch.Tensor:
        h, k = q_HnD.shape[0], k_KnD.shape[0]
        if k % self.size:
            k_KnD, v_KnD = (x.repeat_interleave(h // k, dim=0) for x in (k_KnD, v_KnD))
        o_HND = self.core(self._to_heads(q_HnD), self._to_heads(k_KnD), self._to_heads(v_KnD), tree, scale)
        return self._to_rows(o_HND)


class GatheredKVAttention(nn.Module):
    """Context parallel when ``c`` does not divide the query heads: one all-gather brings every
    rank's q, k and v rows (concatenated over heads: one collective); the tree attention runs
    on the whole tree and each rank keeps its own query rows. The mask is a per-row rule
    (``j <= i < token_end[j]``), so any split of query rows is exact; the attention work is not
    divided (only the rest of the layer is)."""

    def __init__(self, group: dist.ProcessGroup, size: int) -> None:
        super().__init__()
        self.group, self.size = group, size
        self.rank = dist.get_rank(group)
        self.core = TreeAttention()

    def forward(
        self, q_HnD: torch.Tensor, k_KnD: torch.Tensor, v_KnD: torch.Tensor, tree: TreeAttentionMeta, scale: float
    ) -> torch.Tensor:
        h, n, _ = q_HnD.shape
        k = k_KnD.shape[0]
        qkv_nSD = torch.cat([q_HnD, k_KnD, v_KnD], dim=0).transpose(0, 1)  # S = H + 2K, rows first
        gathered: torch.Tensor = _AllGather.apply(qkv_nSD, self.group)
        all_NSD = gathered.transpose(0, 1)
        q_HND, k_KND, v_KND = torch.split(all_NSD, [h, k, k], dim=0)
        o_HND: torch.Tensor = self.core(q_HND, k_KND, v_KND, tree, scale)
        return o_HND[:, self.rank * n : (self.rank + 1) * n]


def apply_cp(model: Transformer, group: dist.ProcessGroup, size: int) -> None:
    """Swap every attention core for a context-parallel one (Ulysses when ``c`` divides the
    local query heads, else gathered K/V)."""
    for block in model.layers.values():
        attn = block.attention
        assert isinstance(attn, Attention)
        heads = attn.wq.out_features // attn.head_dim  # this rank's heads (after tensor parallel)
        attn.core = UlyssesAttention(group, size) if heads % size == 0 else GatheredKVAttention(group, size)


# -- activation checkpointing, compile, FSDP2 ------------------------------------------------


def apply_ac(model: Transformer) -> None:
    """Recompute each block in the backward pass (the tree metadata is an argument, so the
    recomputation sees the same tree)."""
    for block in model.layers.values():
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward


def apply_compile(model: Transformer) -> None:
    """``torch.compile`` per block (CUDA only: the CPU path is the tests' and stays eager)."""
    for block in model.layers.values():
        block.compile()


def apply_fsdp(
    model: Transformer,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    *,
    experts: DeviceMesh | None = None,
) -> None:
    """FSDP2 over the data and context ranks: each block, then the root (embeddings, norm,
    head). ``mp_policy``: 16-bit compute over fp32 master weights, gradients reduced in fp32
    (:func:`treetrain.engines.precision.mixed_precision`).

    With expert parallel each MoE layer's experts are their own FSDP unit over the
    expert-data ranks (``edp`` of ``experts``), sharded along the model width ``d`` (which
    neither ``ep`` nor ``etp`` splits). Their gradients are summed over ``edp`` and divided
    by the data x context ranks (``mesh``'s size): every such rank's tokens reached them
    through the dispatch, so this is the same average the dense weights get."""
    policy = mp_policy
    for block in model.layers.values():
        moe = getattr(block, "moe", None)
        if experts is not None and isinstance(moe, MoE):
            group = moe.experts
            width: dict[nn.Parameter, Shard | None] = {group.w1: Shard(2), group.w3: Shard(2), group.w2: Shard(1)}
            unit = fully_shard(group, mesh=experts["edp"], mp_policy=policy, shard_placement_fn=width.__getitem__)
            unit.set_gradient_divide_factor(float(mesh.size()))
            if experts["edp"].size() > 1:
                # A plain sum, then the division: gloo has no pre-multiplied sum. (With one
                # expert-data rank FSDP divides in its copy, and this would divide twice.)
                unit.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
