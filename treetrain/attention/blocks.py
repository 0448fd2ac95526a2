"""Block-level sparsity of a tree mask, for the fused backends (``flex``, ``triton``).

Letters: N tree tokens, B block size, n = N / B blocks, P live (query block, key block)
pairs.

Everything comes from ``token_end_N`` (see :mod:`treetrain.attention.meta`): query
block ``qb`` sees key block ``kb`` iff ``kb <= qb <= last_q[kb]``. A pair is *full*
(no element mask needed) when every key of ``kb`` is an ancestor-or-self of every query
of ``qb``: ``kb < qb`` and the smallest ``token_end`` in ``kb`` reaches past ``qb``.
No N x N tensor is ever built; the largest object is the n x n block index table
FlexAttention's ``BlockMask`` format asks for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treetrain.attention.meta import TreeAttentionMeta


@dataclass(frozen=True, slots=True)
class BlockSparsity:
    """Live key blocks per query block, in CSR form and split into partial and full pairs."""

    last_q_n: torch.Tensor  # last query block that sees each key block
    kv_ptr_n1: torch.Tensor  # CSR row pointers over query blocks (all live pairs)
    qb_P: torch.Tensor  # query block of each pair, ascending
    kv_idx_P: torch.Tensor  # key blocks, ascending within each query block
    full_P: torch.Tensor  # True where the pair needs no element mask


def block_sparsity(meta: TreeAttentionMeta) -> BlockSparsity:
    b, n_tokens = meta.block_size, meta.num_tokens
    nb = n_tokens // b
    qb_P, kb_P = meta.live_pairs()
    order_P = torch.argsort(qb_P * nb + kb_P)
    qb_P, kb_P = qb_P[order_P], kb_P[order_P]
    ends_nB = meta.token_end_N.view(nb, b)
    last_q_n = (ends_nB.amax(dim=1) - 1) // b
    min_end_n = ends_nB.amin(dim=1)
    full_P = (kb_P < qb_P) & (min_end_n[kb_P] >= (qb_P + 1) * b)
    counts_n = torch.bincount(qb_P, minlength=nb)
    kv_ptr_n1 = torch.zeros(nb + 1, dtype=torch.int32, device=qb_P.device)
    kv_ptr_n1[1:] = torch.cumsum(counts_n, 0)
    return BlockSparsity(
        last_q_n=last_q_n.to(torch.int32),
        kv_ptr_n1=kv_ptr_n1,
        qb_P=qb_P,
        kv_idx_P=kb_P.to(torch.int32),
        full_P=full_P,
    )


def block_table(qb_P: torch.Tensor, kb_P: torch.Tensor, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count per query block ``[n]``, key block indices ``[n, n]`` left-aligned) for ``BlockMask``.

    ``qb_P``/``kb_P`` must be sorted by query block, then key block.
    """
    counts_n = torch.bincount(qb_P, minlength=nb)
    starts_n = torch.cumsum(counts_n, 0) - counts_n
    table_nn = torch.zeros(nb, nb, dtype=torch.int32, device=qb_P.device)
    table_nn[qb_P, torch.arange(qb_P.shape[0], device=qb_P.device) - starts_n[qb_P]] = kb_P.to(torch.int32)
    return counts_n.to(torch.int32), table_nn
