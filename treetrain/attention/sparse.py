"""``sparse``: block-sparse tree attention in plain PyTorch, differentiable by autograd.

Letters: H query heads, K key/value heads, N tokens, D head dim, n blocks of B tokens,
Q query blocks in one group, C key blocks each of them sees.

Only live (query block, key block) pairs are computed (:meth:`TreeAttentionMeta.live_pairs`),
so memory and work follow the tree, not N^2. Query blocks that see the same number C of
key blocks form one group; for a group, the C key blocks of each query block are gathered
into one contiguous run of ``C * B`` keys and a single ``scaled_dot_product_attention``
call (PyTorch's fused kernel where the device has one) computes the group under the exact
element mask ``j <= i < token_end[j]``. Groups are built once per tree and shared by all
layers (:meth:`TreeAttentionMeta.query_groups`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treetrain.attention.meta import TreeAttentionMeta


def sparse_attention(
    q_HND: torch.Tensor, k_KND: torch.Tensor, v_KND: torch.Tensor, meta: TreeAttentionMeta, scaling: float
) -> torch.Tensor:
    """Returns ``[H, N, D]``."""
    h, n, d = q_HND.shape
    b = meta.block_size
    q_HnBD = q_HND.reshape(h, n // b, b, d)
    outs = []
    for group in meta.query_groups():
        q_QHBD = q_HnBD[:, group.query_blocks_Q].transpose(0, 1)
        k_QKTD = k_KND[:, group.key_tokens_QT].transpose(0, 1)  # T = C * B gathered keys
        v_QKTD = v_KND[:, group.key_tokens_QT].transpose(0, 1)
        o_QHBD = F.scaled_dot_product_attention(
            q_QHBD, k_QKTD, v_QKTD, attn_mask=group.mask_Q1BT, scale=scaling, enable_gqa=True
        )
        outs.append(o_QHBD)
    o_nHBD = torch.cat(outs, dim=0)[meta.group_inverse()]  # back to block order
    return o_nHBD.permute(1, 0, 2, 3).reshape(h, n, d)
