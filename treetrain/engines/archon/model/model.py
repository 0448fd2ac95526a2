"""Decoder-only transformer (Llama, Qwen2, Qwen3, Qwen3-MoE) over one packed tree.

Letters: N tokens of the tree on this rank, d model width, H query heads, K key/value heads,
D head dim, E experts, k experts per token, T token-expert assignments, V vocabulary.

There is no batch dimension: a micro-batch is one tree laid out flat, and its mask is
``TreeAttentionMeta`` (``j <= i < token_end[j]``), handed to every layer. Positions are
token depths, so RoPE is indexed by position ids, not by row. No parallelism lives here:
:mod:`..parallelize` shards these modules from the outside (DTensor plans, a swapped
``Attention.core`` for context parallel, hooks on ``GroupedExperts`` for expert parallel).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from treetrain.attention import TreeAttentionMeta, get
from treetrain.engines.archon.model.args import ModelArgs


class RMSNorm(nn.Module):
    """Normalise in fp32, scale in the input dtype (what the Hugging Face models do)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies ``[D / 2]`` with the config's scaling applied (fp32)."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if args.rope_type == "linear":
        return inv / args.rope_factor
    if args.rope_type == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
        old = args.rope_original_max_positions
        low_wavelen = old / args.rope_low_freq_factor
        high_wavelen = old / args.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / args.rope_factor, inv)
        smooth = (old / wavelen - args.rope_low_freq_factor) / (args.rope_high_freq_factor - args.rope_low_freq_factor)
        blended = (1 - smooth) * scaled / args.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv


def rope_cos_sin(
    inv_freq: torch.Tensor, positions_N: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [N, 1, D]`` at each token's position (its depth in the tree)."""
    freqs_ND2 = positions_N.float()[:, None] * inv_freq.float()[None, :]
    emb_ND = torch.cat([freqs_ND2, freqs_ND2], dim=-1)
    return emb_ND.cos().to(dtype)[:, None], emb_ND.sin().to(dtype)[:, None]


def apply_rope(x_NHD: torch.Tensor, cos_N1D: torch.Tensor, sin_N1D: torch.Tensor) -> torch.Tensor:
    # The half-split rotation of the Hugging Face checkpoints (not interleaved pairs).
    x1, x2 = x_NHD.chunk(2, dim=-1)
    return x_NHD * cos_N1D + torch.cat([-x2, x1], dim=-1) * sin_N1D


class TreeAttention(nn.Module):
    """Scaled dot-product attention under the tree mask: the ``treetrain.attention`` backend
    the metadata names. Context parallel swaps this module for one that exchanges heads."""

    def forward(
        self, q_HND: torch.Tensor, k_KND: torch.Tensor, v_KND: torch.Tensor, tree: TreeAttentionMeta, scale: float
    ) -> torch.Tensor:
        return get(tree.backend)(q_HND, k_KND, v_KND, tree, scale)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.core: nn.Module = TreeAttention()  # context parallel swaps it

    def forward(
        self, x_Nd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tree: TreeAttentionMeta
    ) -> torch.Tensor:
        n = x_Nd.shape[0]
        # -1 heads: under tensor parallel each rank holds its own slice of the heads.
        q_NHD = self.wq(x_Nd).view(n, -1, self.head_dim)
        k_NKD = self.wk(x_Nd).view(n, -1, self.head_dim)
        v_NKD = self.wv(x_Nd).view(n, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_NHD, k_NKD = self.q_norm(q_NHD), self.k_norm(k_NKD)
        q_NHD, k_NKD = apply_rope(q_NHD, cos, sin), apply_rope(k_NKD, cos, sin)
        o_HND = self.core(q_NHD.transpose(0, 1), k_NKD.transpose(0, 1), v_NKD.transpose(0, 1), tree, self.scale)
        out_Nd: torch.Tensor = self.wo(o_HND.transpose(0, 1).reshape(n, -1))
        return out_Nd


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class ExpertAdapters(nn.Module):
    """LoRA adapters on the experts' stacked weights (``w1``, ``w3``, ``w2``: gate, up, down),
    one per expert: ``{w}_A [E, r, in]`` and ``{w}_B [E, out, r]`` (fp32, applied in the
    input's dtype), for the weights in ``names``."""

    def __init__(self, names: tuple[str, ...], shapes: dict[str, tuple[int, int, int]], rank: int) -> None:
        super().__init__()
        self.names = names
        for name in names:
            e, n_out, n_in = shapes[name]
            self.register_parameter(f"{name}_A", nn.Parameter(torch.zeros(e, rank, n_in)))
            self.register_parameter(f"{name}_B", nn.Parameter(torch.zeros(e, n_out, rank)))
        self.scale, self.dropout = 1.0, 0.0

    def add(self, name: str, out: torch.Tensor, x: torch.Tensor, e: int) -> torch.Tensor:
        """``out + scale B[e] A[e] dropout(x)`` when ``name`` is adapted, else ``out``."""
        if name not in self.names:
            return out
        a, b = _local(self.get_parameter(f"{name}_A"))[e], _local(self.get_parameter(f"{name}_B"))[e]
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout, training=True)
        return out + F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * self.scale


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights. Input rows arrive sorted by expert with
    ``counts_E`` rows each. Expert parallel moves rows between ranks around this call (hooks),
    so that here the rows and counts are those of the experts this rank holds. ``lora``:
    adapters on the experts (:class:`ExpertAdapters`), None without."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.lora: ExpertAdapters | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x_Td: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        lora = self.lora
        outs = []
        for e, x in enumerate(torch.split(x_Td, counts_E.tolist())):  # host sync: the split sizes
            if lora is None:
                outs.append(F.linear(F.silu(F.linear(x, w1[e])) * F.linear(x, w3[e]), w2[e]))
                continue
            gate, up = lora.add("w1", F.linear(x, w1[e]), x, e), lora.add("w3", F.linear(x, w3[e]), x, e)
            h = F.silu(gate) * up
            outs.append(lora.add("w2", F.linear(h, w2[e]), h, e))
        return torch.cat(outs) if outs else x_Td


def _local(w: torch.Tensor) -> torch.Tensor:
    # Expert parallel shards the stacked weights over experts (a DTensor); compute on this rank's slice.
    to_local = getattr(w, "to_local", None)
    return to_local() if to_local is not None else w


class MoE(nn.Module):
    """Top-k routed experts (softmax router, Qwen3-MoE). Padding tokens are never routed and
    never counted in the load-balancing loss."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_experts = args.n_experts
        self.top_k = args.top_k
        self.norm_topk_prob = args.norm_topk_prob
        self.use_aux_loss = args.use_aux_loss
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(args.dim, args.moe_ffn_dim, args.n_experts)
        self.aux_loss: torch.Tensor | None = None  # the last forward's, when use_aux_loss

    def forward(self, x_Nd: torch.Tensor, valid_N: torch.Tensor) -> torch.Tensor:
        n, e = x_Nd.shape[0], self.n_experts
        probs_NE = torch.softmax(self.router(x_Nd).float(), dim=-1)
        top_p_Nk, top_i_Nk = torch.topk(probs_NE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_p_Nk = top_p_Nk / top_p_Nk.sum(dim=-1, keepdim=True)
        # Assignments of real tokens only, sorted by expert.
        token_Nk = torch.arange(n, device=x_Nd.device)[:, None].expand(-1, self.top_k)
        keep_Nk = valid_N[:, None].expand(-1, self.top_k)
        expert_T, token_T, weight_T = top_i_Nk[keep_Nk], token_Nk[keep_Nk], top_p_Nk[keep_Nk]
        order_T = torch.argsort(expert_T, stable=True)
        expert_T, token_T, weight_T = expert_T[order_T], token_T[order_T], weight_T[order_T]
        counts_E = torch.bincount(expert_T, minlength=e)
        y_Td = self.experts(x_Nd[token_T], counts_E) * weight_T[:, None].to(x_Nd.dtype)
        out_Nd = torch.zeros_like(x_Nd).index_add_(0, token_T, y_Td)
        if self.use_aux_loss:
            # Switch-style balance: E * sum_e (share of assignments to e) * (mean router prob of e).
            real = valid_N.float()
            tokens = real.sum().clamp(min=1)
            share_E = counts_E.float() / (tokens * self.top_k)
            mean_p_E = (probs_NE * real[:, None]).sum(0) / tokens
            self.aux_loss = e * (share_E * mean_p_E).sum()
        return out_Nd


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args) if layer_id in args.moe_layers else None
        self.feed_forward = FeedForward(args.dim, args.ffn_dim) if self.moe is None else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tree: TreeAttentionMeta, valid_N: torch.Tensor
    ) -> torch.Tensor:
        h: torch.Tensor = x + self.attention(self.attention_norm(x), cos, sin, tree)
        ffn = self.moe(self.ffn_norm(h), valid_N) if self.moe is not None else self.feed_forward(self.ffn_norm(h))  # type: ignore[misc]
        out: torch.Tensor = h + ffn
        return out


class Transformer(nn.Module):
    """Embeddings, blocks, final norm and a head: ``output`` (logits ``[N, V]``) for actors and
    references, ``value_head`` (values ``[N]``) for critics.

    Pipeline stages keep a slice of ``layers`` (a dict, so names stay those of the whole
    model) and set the modules they do not run to None; the forward skips them. A stage
    after the first takes hidden states ``[N, d]`` instead of token ids.
    """

    def __init__(self, args: ModelArgs, *, value_head: bool = False) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = None if value_head else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.value_head: nn.Linear | None = nn.Linear(args.dim, 1) if value_head else None
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions_N: torch.Tensor,
        tree: TreeAttentionMeta,
        valid_N: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens``: ids ``[N]`` (first stage) or hidden states ``[N, d]``; ``valid_N``: False
        on padding (never routed to experts). Returns logits, values, or hidden states."""
        h: torch.Tensor = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if valid_N is None:
            valid_N = torch.ones(positions_N.shape[0], dtype=torch.bool, device=positions_N.device)
        cos, sin = rope_cos_sin(self.get_buffer("inv_freq"), positions_N, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin, tree, valid_N)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        elif self.value_head is not None:
            h = self.value_head(h).squeeze(-1)
        return h

    def moe_aux_loss(self) -> torch.Tensor | None:
        """Sum of the last forward's load-balancing losses (None without any)."""
        losses = [m.aux_loss for m in self.modules() if isinstance(m, MoE) and m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None
