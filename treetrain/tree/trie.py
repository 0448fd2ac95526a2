"""Sorting sequences into trie order, and the adjacent longest-common-prefix array.

Everything here is plain Python on lists (or ``array.array`` rows) of ints: no torch, no
device. The trie is never built as linked node objects. Sorting the sequences
lexicographically visits the trie depth-first (children in token order), and the longest
common prefix (LCP) of each sequence with the one sorted before it is all that is needed to
lay out the tree and to find its nodes (see :mod:`treetrain.tree.layout`). Both steps run
at C speed: ``sorted`` compares lists element-wise in C (arrays of one type code about 20x
faster: no int objects), and :func:`common_prefix` compares slices.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import cast


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (lists compared in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def trie_order(sequences: Sequence[list[int]] | Sequence[array[int]]) -> tuple[list[int], list[int]]:
    """Sort sequence indices into depth-first trie order and return ``(order, lcp)``.

    ``order[k]`` is an index into ``sequences``; ``lcp[k]`` is the common prefix length of
    ``sequences[order[k - 1]]`` and ``sequences[order[k]]`` (``lcp[0] == 0``). The sort is
    stable, so duplicates keep input order and the result is deterministic.
    """
    # Rows of one kind (all lists, or all arrays) compare with each other: the cast says so.
    order = sorted(range(len(sequences)), key=cast(Callable[[int], list[int]], sequences.__getitem__))
    lcp = [0] * len(order)
    for k in range(1, len(order)):
        lcp[k] = common_prefix(sequences[order[k - 1]], sequences[order[k]])
    return order, lcp
