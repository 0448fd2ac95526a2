"""How an Archon model is spread over the ranks: small ``apply_*`` functions, applied by
:func:`parallelize` in a fixed order (tensor, expert, context parallel, activation
checkpointing, compile, FSDP2). The model code knows none of it.

Expert parallel is :mod:`.experts`. Letters: N tree tokens (n = N / c on one context rank), H
query heads, K key/value heads, D head dim, c context-parallel size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from treetrain.alloc.precision import Precision
from treetrain.attention import TreeAttentionMeta
from treetrain.config.lora import LoraSettings
from treetrain.engines.archon.experts import apply_ep
from treetrain.engines.archon.layout import ArchonLayout
from treetrain.engines.archon.model import Attention, ModelArgs, MoE, Transformer, TreeAttention
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.layout import one_rank_mesh
from treetrain.engines.precision import mixed_precision


def parallelize(
    model: Transformer,
    layout: ArchonLayout,
    prec: Precision,
    *,
    checkpointing: bool,
    lora: tuple[LoraSettings, tuple[str, ...]] | None = None,
) -> Transformer:
    """Apply the strategy in place. Tensor parallel goes first so that FSDP then shards the
    already tensor-parallel parameters (2-D); context parallel only swaps attention cores;
    checkpointing and compile wrap whole blocks before FSDP wraps them once more. FSDP2 wraps
    the model when ``prec.fsdp`` (data x context ranks > 1, or 16-bit compute over fp32
    master weights: then over a one-rank mesh when nothing is sharded). ``lora``: adapters
    (settings, targets) attached once tensor and expert parallel have split the weights
    (:mod:`.lora`), the base frozen."""
    if layout.mesh is not None and layout.tp > 1:
        apply_tp(model, layout.mesh["tp"])
    if layout.experts is not None:
        apply_ep(model, layout.experts)
    if lora is not None:
        from treetrain.engines.archon.lora import apply_lora

        apply_lora(model, layout, *lora)
    if layout.cp > 1:
        apply_cp(model, layout.group_of("cp"), layout.cp)
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
            if group.lora is not None:
                from treetrain.engines.archon.lora import fsdp_placement

                width |= {p: fsdp_placement(n) for n, p in group.lora.named_parameters()}
            unit = fully_shard(group, mesh=experts["edp"], mp_policy=policy, shard_placement_fn=width.__getitem__)
            unit.set_gradient_divide_factor(float(mesh.size()))
            if experts["edp"].size() > 1:
                # A plain sum, then the division: gloo has no pre-multiplied sum. (With one
                # expert-data rank FSDP divides in its copy, and this would divide twice.)
                unit.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
