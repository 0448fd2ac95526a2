"""``triton``: fused tree attention kernels, forward and backward, in Triton.

Letters: H query heads, K key/value heads (G = H / K per group), N tree tokens, D head
dim, B block size, n = N / B blocks, P live block pairs.

The kernels read the tree only through ``token_end`` (one int per token) and the block
lists of :func:`treetrain.attention.blocks.block_sparsity`, built once per micro-batch
on the device:

- forward and dQ: one program per (query block, head) walks that block's live key
  blocks (CSR ``kv_ptr``/``kv_idx``);
- dK/dV: one program per (key block, key/value head) walks the contiguous run of query
  blocks ``kb .. last_q[kb]`` for every head of its group, so GQA needs no atomics.

Inside a block pair the element mask is ``kv <= q < token_end[kv]``, computed from the
loaded ``token_end`` values. There are no packed mask bit-words anywhere, so no branch
offset can make a live block look empty (AReaL's kernel sums 64-bit words and can drop
such blocks). The softmax is the online (flash) form with log-sum-exp saved for the
backward pass; rows that see nothing yet in a block are guarded against ``-inf - -inf``.

On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` set before
treetrain imports this module): slow, for tests only.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from treetrain.attention.blocks import BlockSparsity, block_sparsity
from treetrain.attention.meta import TreeAttentionMeta

_SPARSITY: weakref.WeakKeyDictionary[TreeAttentionMeta, BlockSparsity] = weakref.WeakKeyDictionary()


class TritonUnavailableError(RuntimeError):
    """The ``triton`` backend cannot run on this device or install."""


def triton_attention(
    q_HND: torch.Tensor, k_KND: torch.Tensor, v_KND: torch.Tensor, meta: TreeAttentionMeta, scaling: float
) -> torch.Tensor:
    """Returns ``[H, N, D]``; differentiable."""
    check_available(q_HND.device)
    sparsity = _SPARSITY.get(meta)
    if sparsity is None:
        sparsity = _SPARSITY[meta] = block_sparsity(meta)
    out: torch.Tensor = _TreeAttention.apply(q_HND, k_KND, v_KND, meta, sparsity, scaling)
    return out


def check_available(device: torch.device) -> None:
    """Raise a clear error when the kernels cannot run on ``device``."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise TritonUnavailableError(
            f"attention='triton' needs a CUDA GPU (tensors are on {device.type}); on CPU use attention='sparse' "
            "(or 'auto'), or set TRITON_INTERPRET=1 before starting Python to run the kernels in Triton's "
            "interpreter (slow; for tests)"
        )
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise TritonUnavailableError(
            "attention='triton' needs the triton package: pip install 'treetrain[train]'"
        ) from exc


class _TreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q_HND: torch.Tensor,
        k_KND: torch.Tensor,
        v_KND: torch.Tensor,
        meta: TreeAttentionMeta,
        sparsity: BlockSparsity,
        scaling: float,
    ) -> torch.Tensor:
        from treetrain.attention import _triton_kernels as kernels

        q_HND, k_KND, v_KND = q_HND.contiguous(), k_KND.contiguous(), v_KND.contiguous()
        o_HND, lse_HN = kernels.forward(q_HND, k_KND, v_KND, meta.token_end_N, sparsity, meta.block_size, scaling)
        ctx.save_for_backward(q_HND, k_KND, v_KND, o_HND, lse_HN)
        ctx.meta, ctx.sparsity, ctx.scaling = meta, sparsity, scaling
        return o_HND

    @staticmethod
    def backward(ctx: Any, do_HND: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from treetrain.attention import _triton_kernels as kernels

        q_HND, k_KND, v_KND, o_HND, lse_HN = ctx.saved_tensors
        meta: TreeAttentionMeta = ctx.meta
        dq, dk, dv = kernels.backward(
            q_HND, k_KND, v_KND, o_HND, lse_HN, do_HND.contiguous(), meta.token_end_N, ctx.sparsity,
            meta.block_size, ctx.scaling,
        )  # fmt: skip
        return dq, dk, dv, None, None, None
