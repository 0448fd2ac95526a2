"""``dense``: scaled-dot-product attention under an N x N boolean tree mask (the reference).

Letters: H query heads, K key/value heads, N tree tokens, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treetrain.attention.meta import TreeAttentionMeta


def dense_attention(
    q_HND: torch.Tensor, k_KND: torch.Tensor, v_KND: torch.Tensor, meta: TreeAttentionMeta, scaling: float
) -> torch.Tensor:
    """Returns ``[H, N, D]``."""
    mask_NN = meta.dense_mask()
    return F.scaled_dot_product_attention(
        q_HND[None], k_KND[None], v_KND[None], attn_mask=mask_NN, scale=scaling, enable_gqa=True
    )[0]
