"""``flex``: PyTorch FlexAttention with a ``BlockMask`` built from the tree metadata.

Letters: H query heads, K key/value heads, N tree tokens, D head dim, n blocks.

The block mask comes from :func:`treetrain.attention.blocks.block_sparsity` (O(n)
work plus the n x n block table the format needs); ``mask_mod`` evaluates the exact
tree rule ``kv <= q < token_end[kv]`` inside partial blocks only. On CUDA the call is
compiled once per process. On CPU FlexAttention has no backward and this build cannot
compile it, so ``flex`` there is forward-only (log-prob recomputation under
``torch.no_grad()``) and refuses gradients with a clear message.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from treetrain.attention.blocks import block_sparsity, block_table
from treetrain.attention.meta import TreeAttentionMeta

_MASKS: weakref.WeakKeyDictionary[TreeAttentionMeta, Any] = weakref.WeakKeyDictionary()


class FlexUnavailableError(RuntimeError):
    """``flex`` was asked for something it cannot do on this device."""


def tree_block_mask(meta: TreeAttentionMeta) -> Any:
    """The ``BlockMask`` of one packed tree (built once, shared by every layer)."""
    cached = _MASKS.get(meta)
    if cached is not None:
        return cached
    from torch.nn.attention.flex_attention import BlockMask

    b, nb = meta.block_size, meta.num_tokens // meta.block_size
    sparsity = block_sparsity(meta)
    qb_P, kb_P, full_P = sparsity.qb_P, sparsity.kv_idx_P.long(), sparsity.full_P
    partial_num_n, partial_idx_nn = block_table(qb_P[~full_P], kb_P[~full_P], nb)
    full_num_n, full_idx_nn = block_table(qb_P[full_P], kb_P[full_P], nb)
    token_end_N = meta.token_end_N

    def tree_mask_mod(batch: torch.Tensor, head: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (q < token_end_N[kv])

    mask = BlockMask.from_kv_blocks(
        partial_num_n[None, None],
        partial_idx_nn[None, None],
        full_num_n[None, None],
        full_idx_nn[None, None],
        BLOCK_SIZE=b,
        mask_mod=tree_mask_mod,
        seq_lengths=(meta.num_tokens, meta.num_tokens),
    )
    _MASKS[meta] = mask
    return mask


@functools.cache
def _compiled() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention(
    q_HND: torch.Tensor, k_KND: torch.Tensor, v_KND: torch.Tensor, meta: TreeAttentionMeta, scaling: float
) -> torch.Tensor:
    """Returns ``[H, N, D]``."""
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_HND, k_KND, v_KND))
    block_mask = tree_block_mask(meta)
    args = (q_HND[None], k_KND[None], v_KND[None])
    if q_HND.device.type == "cuda":
        return _compiled()(*args, block_mask=block_mask, scale=scaling, enable_gqa=True)[0]
    if wants_grad:
        raise FlexUnavailableError(
            f"attention='flex' has no backward on {q_HND.device.type}: FlexAttention computes gradients on CUDA "
            "only. Train with attention='sparse' (or 'auto') here; 'flex' on CPU is for forward passes under "
            "torch.no_grad(), such as log-prob recomputation."
        )
    with warnings.catch_warnings():
        # Off CUDA the unfused reference path is the only one; it is correct, and expected here.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return eager_flex(*args, block_mask=block_mask, scale=scaling, enable_gqa=True)[0]
