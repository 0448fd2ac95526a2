"""Tree packing: token sequences that share prefixes become tries, laid out flat.

Plain data only (no torch): :func:`pack` turns sequences into a :class:`PackedBatch` of
:class:`PackedTree` micro-batches, each with padded input ids, position ids (token depth)
and O(N) metadata (per-token node id and subtree end, node start/end/parent, per-sequence
token positions). :mod:`treetrain.attention` and :mod:`treetrain.logprob` turn that
metadata into tensors.
"""

from treetrain.tree.layout import PAD_TOKEN_ID, PackedTree, layout_tree, pad_tree
from treetrain.tree.pack import (
    DEFAULT_BLOCK_SIZE,
    PackConfig,
    PackedBatch,
    PackingError,
    PackStats,
    pack,
    pack_stats,
)
from treetrain.tree.trie import common_prefix, trie_order

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "PAD_TOKEN_ID",
    "PackConfig",
    "PackStats",
    "PackedBatch",
    "PackedTree",
    "PackingError",
    "common_prefix",
    "layout_tree",
    "pack",
    "pack_stats",
    "pad_tree",
    "trie_order",
]
