"""``sparse``: block-sparse tree attention in plain PyTorch, differentiable by autograd.

Letters: K key/value heads, G query heads per key head, n blocks of B tokens, P live
(query block, key block) pairs, D head dim.

Only the live pairs of :meth:`TreeAttentionMeta.live_pairs` are computed, so memory and
work follow the tree, not N^2. Each pair gets the exact element mask from ``token_end``;
the softmax is combined across all pairs of a query block with a per-row maximum
(detached: it only shifts the exponent) and ``index_add`` sums, which autograd handles.
"""

from __future__ import annotations

import torch

from treetrain.attention.meta import TreeAttentionMeta


def sparse_attention(
    q_HND: torch.Tensor, k_KND: torch.Tensor, v_KND: torch.Tensor, meta: TreeAttentionMeta, scaling: float
) -> torch.Tensor:
    """Returns ``[H, N, D]``."""
    h, n, d = q_HND.shape
    kh = k_KND.shape[0]
    b = meta.block_size
    nb = n // b
    qb_P, kb_P = meta.live_pairs()
    q_KGnBD = q_HND.reshape(kh, h // kh, nb, b, d)
    k_KnBD = k_KND.reshape(kh, nb, b, d)
    v_KnBD = v_KND.reshape(kh, nb, b, d)

    # Element mask of each live pair: key j is visible to query i iff j <= i < token_end[j].
    offs_B = torch.arange(b, device=q_HND.device)
    i_PB1 = (qb_P[:, None] * b + offs_B)[:, :, None]
    j_P1B = (kb_P[:, None] * b + offs_B)[:, None, :]
    allowed_PBB = (j_P1B <= i_PB1) & (i_PB1 < meta.token_end_N[j_P1B])

    s_KGPBB = torch.einsum("kgpid,kpjd->kgpij", q_KGnBD[:, :, qb_P], k_KnBD[:, kb_P])
    s_KGPBB = s_KGPBB.to(torch.promote_types(s_KGPBB.dtype, torch.float32)) * scaling  # half -> fp32
    s_KGPBB = s_KGPBB.masked_fill(~allowed_PBB, float("-inf"))
    # Every query sees itself in its diagonal pair, so each row max below is finite.
    rowmax_KGPB = s_KGPBB.detach().amax(dim=-1)
    idx_KGPB = qb_P[None, None, :, None].expand_as(rowmax_KGPB)
    m_KGnB = torch.full((kh, h // kh, nb, b), float("-inf"), dtype=s_KGPBB.dtype, device=q_HND.device)
    m_KGnB = m_KGnB.scatter_reduce(2, idx_KGPB, rowmax_KGPB, reduce="amax")
    e_KGPBB = torch.exp(s_KGPBB - m_KGnB[:, :, qb_P, :, None])
    denom_KGnB = torch.zeros_like(m_KGnB).index_add(2, qb_P, e_KGPBB.sum(dim=-1))
    pv_KGPBD = torch.einsum("kgpij,kpjd->kgpid", e_KGPBB.to(v_KND.dtype), v_KnBD[:, kb_P])
    o_KGnBD = torch.zeros((kh, h // kh, nb, b, d), dtype=pv_KGPBD.dtype, device=q_HND.device)
    o_KGnBD = o_KGnBD.index_add(2, qb_P, pv_KGPBD)
    o_KGnBD = o_KGnBD / denom_KGnB[..., None].to(o_KGnBD.dtype)
    return o_KGnBD.reshape(h, n, d)
