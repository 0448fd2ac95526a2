"""Flattened layout of one packed tree: token ids, depths and O(N) node metadata.

Sequences arrive in trie (lexicographic) order with ``lcp[k]``, the common prefix length
of sequence ``k`` with sequence ``k - 1``. Appending each sequence's unshared suffix
(``seq[lcp[k]:]``) in that order lays the trie out depth-first, parents before children,
and every subtree occupies one contiguous token range. That gives the whole tree mask
from one integer per token::

    token j is visible to query i  <=>  j <= i < token_end[j]

where ``token_end[j]`` is the end of the subtree of ``j``'s node. No N x N structure is
ever built here (only the ``dense`` reference attention backend builds one).

Nodes (compressed single-child chains) start at each appended suffix and wherever a later
sequence branches off an earlier path; a node also breaks where a sequence ends, because
a sequence that ends is either the prefix of the next one (whose suffix starts a node) or
a duplicate (which adds no tokens).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace

PAD_TOKEN_ID = 0


@dataclass(frozen=True, slots=True)
class PackedTree:
    """One micro-batch: a forest of tries laid out flat, padded to ``padded_len``.

    Per-token lists have ``padded_len`` entries; padding tokens get id ``PAD_TOKEN_ID``,
    position 0, node -1 and ``token_end[j] == j + 1`` (each attends only to itself).
    ``seq_ids`` are the input indices of the sequences in layout order; sequence ``k``
    reads tokens ``seq_tokens[seq_offsets[k]:seq_offsets[k + 1]]`` in order.
    """

    seq_ids: tuple[int, ...]
    num_tokens: int
    padded_len: int
    input_ids: list[int]
    position_ids: list[int]
    token_node: list[int]
    token_end: list[int]
    node_start: list[int]
    node_end: list[int]
    node_parent: list[int]
    seq_offsets: list[int]
    seq_tokens: list[int]

    @property
    def num_nodes(self) -> int:
        return len(self.node_start)

    @property
    def num_padding(self) -> int:
        return self.padded_len - self.num_tokens

    def sequence_tokens(self, k: int) -> list[int]:
        """Flat token positions of the ``k``-th sequence of this tree (layout order)."""
        return self.seq_tokens[self.seq_offsets[k] : self.seq_offsets[k + 1]]

    def attended_pairs(self) -> int:
        """Number of (query, key) pairs the tree mask allows among real tokens."""
        return sum(self.position_ids[: self.num_tokens]) + self.num_tokens


def layout_tree(
    sequences: Sequence[list[int]], seq_ids: Sequence[int], lcp: Sequence[int], padded_len: int
) -> PackedTree:
    """Lay out ``sequences`` (already in trie order, ``lcp[0]`` ignored) as one tree."""
    input_ids: list[int] = []
    position_ids: list[int] = []
    seq_tokens: list[int] = []
    seq_offsets = [0]
    # start position of each node -> position of its parent token (-1: a root)
    parent_token: dict[int, int] = {}
    prev: list[int] = []  # token positions of the previous sequence
    pos = 0
    for k, seq in enumerate(sequences):
        c = lcp[k] if k else 0
        length = len(seq)
        if c < len(prev):  # the previous path branches at depth c: a node starts there
            parent_token.setdefault(prev[c], prev[c - 1] if c else -1)
        if length > c:
            parent_token[pos] = prev[c - 1] if c else -1
            input_ids += seq[c:]
            position_ids += range(c, length)
            idx = prev[:c]
            idx += range(pos, pos + length - c)
            pos += length - c
        else:  # a duplicate of the previous sequence
            idx = prev[:c]
        seq_tokens += idx
        seq_offsets.append(len(seq_tokens))
        prev = idx
    num_tokens = pos
    assert num_tokens <= padded_len, (num_tokens, padded_len)

    node_start = sorted(parent_token)
    node_end = [*node_start[1:], num_tokens] if node_start else []
    node_parent = [-1 if (t := parent_token[s]) < 0 else bisect_right(node_start, t) - 1 for s in node_start]
    subtree_end = list(node_end)
    for n in range(len(node_start) - 1, 0, -1):  # children come after parents
        p = node_parent[n]
        if p >= 0 and subtree_end[n] > subtree_end[p]:
            subtree_end[p] = subtree_end[n]
    token_node: list[int] = []
    token_end: list[int] = []
    for n, (s, e) in enumerate(zip(node_start, node_end, strict=True)):
        token_node += [n] * (e - s)
        token_end += [subtree_end[n]] * (e - s)

    pad = padded_len - num_tokens
    input_ids += [PAD_TOKEN_ID] * pad
    position_ids += [0] * pad
    token_node += [-1] * pad
    token_end += range(num_tokens + 1, padded_len + 1)
    return PackedTree(
        seq_ids=tuple(seq_ids),
        num_tokens=num_tokens,
        padded_len=padded_len,
        input_ids=input_ids,
        position_ids=position_ids,
        token_node=token_node,
        token_end=token_end,
        node_start=node_start,
        node_end=node_end,
        node_parent=node_parent,
        seq_offsets=seq_offsets,
        seq_tokens=seq_tokens,
    )


def pad_tree(tree: PackedTree, length: int) -> PackedTree:
    """``tree`` padded to ``length`` tokens with the layout's padding (id ``PAD_TOKEN_ID``,
    position 0, node -1, each token attending only to itself): no real token's result changes.
    Returns ``tree`` itself when it is already ``length`` long; a shorter ``length`` than
    ``tree.padded_len`` is a ``ValueError`` (padding is never cut)."""
    extra = length - tree.padded_len
    if extra < 0:
        raise ValueError(f"cannot pad a tree of {tree.padded_len} tokens to {length}: padding is never cut")
    if extra == 0:
        return tree
    return replace(
        tree,
        padded_len=length,
        input_ids=[*tree.input_ids, *[PAD_TOKEN_ID] * extra],
        position_ids=[*tree.position_ids, *[0] * extra],
        token_node=[*tree.token_node, *[-1] * extra],
        token_end=[*tree.token_end, *range(tree.padded_len + 1, length + 1)],
    )
