"""Tensors one tree attention call needs, built once per micro-batch and shared by all layers.

Letters: N padded tree tokens, B block size, n = N / B blocks, P live (query block, key
block) pairs, M gathered log-prob positions.

The whole tree mask is one integer per token (see :mod:`treetrain.tree.layout`)::

    allowed[i, j] = (j <= i) & (i < token_end_N[j])

Key block ``kb`` is therefore seen by the contiguous run of query blocks
``kb .. (max(token_end in kb) - 1) // B``: the live pairs come from an O(n) computation.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from treetrain.tree import PackedTree


def long_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A 1-D int64 tensor from a list of ints, via a C array (several times faster than
    ``torch.tensor(list)``)."""
    if not values:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.frombuffer(array("q", values), dtype=torch.long).to(device)


@dataclass(frozen=True, slots=True)
class QueryGroup:
    """Query blocks that each see C key blocks, with the gathered key positions and mask."""

    query_blocks_Q: torch.Tensor
    key_tokens_QT: torch.Tensor  # T = C * B token positions, C live key blocks per query block
    mask_Q1BT: torch.Tensor


@dataclass(eq=False)
class TreeAttentionMeta:
    """Tree mask metadata on the model's device. Pass it as ``tree_attention=`` to the model."""

    backend: str
    token_end_N: torch.Tensor
    block_size: int
    _dense_mask_NN: torch.Tensor | None = field(default=None, repr=False)
    _pairs: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _groups: list[QueryGroup] | None = field(default=None, repr=False)
    _group_inverse: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_tree(cls, tree: PackedTree, *, backend: str, block_size: int, device: torch.device) -> TreeAttentionMeta:
        token_end_N = long_tensor(tree.token_end, device)
        return cls(backend=backend, token_end_N=token_end_N, block_size=block_size)

    @property
    def num_tokens(self) -> int:
        return int(self.token_end_N.shape[0])

    def dense_mask(self) -> torch.Tensor:
        """The N x N boolean mask (the ``dense`` reference backend only)."""
        if self._dense_mask_NN is None:
            n = self.num_tokens
            i_N1 = torch.arange(n, device=self.token_end_N.device)[:, None]
            j_1N = torch.arange(n, device=self.token_end_N.device)[None, :]
            self._dense_mask_NN = (j_1N <= i_N1) & (i_N1 < self.token_end_N[None, :])
        return self._dense_mask_NN

    def live_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(query block, key block) index pairs that hold at least one allowed entry."""
        if self._pairs is None:
            b, n = self.block_size, self.num_tokens
            if n % b:
                raise ValueError(f"tree length {n} is not a multiple of block size {b}; pad trees to the block size")
            nb = n // b
            device = self.token_end_N.device
            last_q_n = (self.token_end_N.view(nb, b).amax(dim=1) - 1) // b
            kb_n = torch.arange(nb, device=device)
            counts_n = last_q_n - kb_n + 1
            kb_P = torch.repeat_interleave(kb_n, counts_n)
            starts_n = torch.cumsum(counts_n, 0) - counts_n
            qb_P = kb_P + torch.arange(kb_P.shape[0], device=device) - starts_n[kb_P]
            self._pairs = (qb_P, kb_P)
        return self._pairs

    def live_fraction(self) -> float:
        """Live block pairs over all n * n pairs (a host sync; for reports only)."""
        nb = self.num_tokens // self.block_size
        return float(self.live_pairs()[0].shape[0]) / (nb * nb)

    def query_groups(self) -> list[QueryGroup]:
        """Query blocks grouped by how many key blocks they see (built once, host syncs here)."""
        if self._groups is None:
            b, nb = self.block_size, self.num_tokens // self.block_size
            device = self.token_end_N.device
            qb_P, kb_P = self.live_pairs()
            order_P = torch.argsort(qb_P * nb + kb_P)
            kb_sorted_P = kb_P[order_P]
            counts_n = torch.bincount(qb_P, minlength=nb)
            starts_n = torch.cumsum(counts_n, 0) - counts_n
            offs_B = torch.arange(b, device=device)
            # A key block is fully visible to a query block when it lies before it and every key's
            # subtree reaches past the query block's last token; only the other pairs (the diagonal
            # and blocks where a subtree ends) need the element mask computed.
            min_end_n = self.token_end_N.view(nb, b).amin(dim=1)
            groups: list[QueryGroup] = []
            for c in torch.unique(counts_n).tolist():  # host sync: once per tree
                qbs_Q = torch.nonzero(counts_n == c).flatten()
                kbs_QC = kb_sorted_P[starts_n[qbs_Q, None] + torch.arange(c, device=device)]
                keys_QT = (kbs_QC[:, :, None] * b + offs_B).flatten(1)
                full_QC = (kbs_QC < qbs_Q[:, None]) & (min_end_n[kbs_QC] >= (qbs_Q[:, None] + 1) * b)
                mask_QBCB = full_QC[:, None, :, None].expand(-1, b, -1, b).clone()
                part_q, part_c = torch.nonzero(~full_QC, as_tuple=True)  # R partial pairs
                rows_RB1 = (qbs_Q[part_q, None] * b + offs_B)[:, :, None]
                cols_R1B = (kbs_QC[part_q, part_c, None] * b + offs_B)[:, None, :]
                mask_QBCB[part_q, :, part_c, :] = (cols_R1B <= rows_RB1) & (rows_RB1 < self.token_end_N[cols_R1B])
                mask_Q1BT = mask_QBCB.view(qbs_Q.shape[0], 1, b, c * b)
                groups.append(QueryGroup(query_blocks_Q=qbs_Q, key_tokens_QT=keys_QT, mask_Q1BT=mask_Q1BT))
            self._groups = groups
            self._group_inverse = torch.argsort(torch.cat([g.query_blocks_Q for g in groups]))
        return self._groups

    def group_inverse(self) -> torch.Tensor:
        """Permutation from concatenated group order back to query block order."""
        self.query_groups()
        assert self._group_inverse is not None
        return self._group_inverse
