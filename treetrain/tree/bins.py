"""How a batch's sorted sequences become trees and trees go to ranks: the cut into maximal
subtrees that fit a micro-batch, best-fit decreasing over those items (preferring a tree that
already shares a prefix), and the split and assignment over the data-parallel ranks. Internal to
:mod:`treetrain.tree.pack`; positions are indices into the trie order."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass
from typing import Any


class RangeMin:
    """O(1) minimum of ``lcp[a:b]`` (sparse table), i.e. common prefix of sorted positions."""

    def __init__(self, values: list[int]) -> None:
        self.table = [values]
        width = 1
        while 2 * width <= len(values):
            prev = self.table[-1]
            self.table.append([min(prev[i], prev[i + width]) for i in range(len(prev) - width)])
            width *= 2

    def lcp(self, a: int, b: int) -> int:
        """Common prefix of sorted sequences ``a < b``: min of ``lcp[a + 1 : b + 1]``."""
        lo, hi = a + 1, b + 1
        level = (hi - lo).bit_length() - 1
        row = self.table[level]
        return min(row[lo], row[hi - (1 << level)])


@dataclass(slots=True)
class Bin:
    starts: list[int]  # sorted start positions of its item ranges
    ends: list[int]
    cost: int


def cut_items(n: int, lcp: list[int], cap: int, range_cost: Any) -> list[tuple[int, int]]:
    """Maximal subtrees (ranges of sorted positions) that fit in ``cap``, in sorted order."""
    items: list[tuple[int, int]] = []
    stack = [(0, n)] if n else []
    while stack:
        lo, hi = stack.pop()
        if range_cost(lo, hi) <= cap:
            items.append((lo, hi))
            continue
        # Too big: cut at the branch point shared by the whole range. A single sequence (or a
        # run of duplicates) always fits, because _validate checked each length.
        depth = min(lcp[lo + 1 : hi])
        bounds = [lo, *(k for k in range(lo + 1, hi) if lcp[k] == depth), hi]
        stack.extend((bounds[j], bounds[j + 1]) for j in range(len(bounds) - 2, -1, -1))
    return items


# How many items to look at on each side of an item (in trie order) for trees it shares a prefix with.
NEIGHBOR_WINDOW = 32


def best_fit(items: list[tuple[int, int]], cap: int, range_cost: Any, rmq: RangeMin, n: int) -> list[Bin]:
    """Best-fit decreasing by added tree tokens, in O(items * (window + log bins)).

    Trees that hold a sequence near the item in sorted order get their exact sharing; every
    other tree is judged by capacity alone (shared tokens counted as 0, which can only
    overestimate), through a cost-sorted list. The chosen tree's cost is then made exact.
    """
    bins: list[Bin] = []
    bin_of = [-1] * n  # sorted position -> its bin
    item_lo, item_hi = [0] * n, [0] * n  # sorted position -> bounds of its item
    for lo, hi in items:
        item_lo[lo:hi] = [lo] * (hi - lo)
        item_hi[lo:hi] = [hi] * (hi - lo)
    by_cost: list[tuple[int, int]] = []  # (bin cost, bin index), sorted
    for lo, hi in sorted(items, key=lambda it: (-range_cost(*it), it[0])):
        cost = range_cost(lo, hi)
        # Every sequence shares at least `floor` tokens with the item (e.g. a BOS token or a
        # prompt common to the whole batch), so every non-empty tree saves at least that much.
        floor = min(rmq.lcp(0, lo) if lo > 0 else cost, rmq.lcp(hi - 1, n - 1) if hi < n else cost)
        best: tuple[int, int, int] | None = None  # (added tokens, -bin cost, bin index)
        for bi in _neighbor_bins(lo, hi, floor, bin_of, (item_lo, item_hi), rmq, n):
            b = bins[bi]
            added = cost - _shared(b, lo, hi, rmq)
            if b.cost + added <= cap and (best is None or (added, -b.cost, bi) < best):
                best = (added, -b.cost, bi)
        j = bisect_right(by_cost, (cap - cost + floor, len(bins))) - 1  # the fullest tree with room
        if j >= 0 and (best is None or (cost - floor, -by_cost[j][0], by_cost[j][1]) < best):
            best = (cost - floor, -by_cost[j][0], by_cost[j][1])
        if best is None:
            bi = len(bins)
            bins.append(Bin(starts=[lo], ends=[hi], cost=cost))
        else:
            bi = best[2]
            b = bins[bi]
            by_cost.remove((b.cost, bi))
            b.cost += cost - _shared(b, lo, hi, rmq)
            k = bisect_left(b.starts, lo)
            b.starts.insert(k, lo)
            b.ends.insert(k, hi)
        insort(by_cost, (bins[bi].cost, bi))
        bin_of[lo:hi] = [bi] * (hi - lo)
    bins.sort(key=lambda b: b.starts[0])
    return bins


def _neighbor_bins(
    lo: int, hi: int, floor: int, bin_of: list[int], bounds: tuple[list[int], list[int]], rmq: RangeMin, n: int
) -> list[int]:
    """Bins holding the nearest ``NEIGHBOR_WINDOW`` items on each side of [lo, hi) in trie order
    that share more than ``floor`` tokens with it (every tree shares ``floor``)."""
    item_lo, item_hi = bounds
    found: list[int] = []
    x, steps = lo - 1, 0
    while x >= 0 and steps < NEIGHBOR_WINDOW and rmq.lcp(x, lo) > floor:  # prefixes shrink further away
        if bin_of[x] >= 0 and bin_of[x] not in found:
            found.append(bin_of[x])
        x, steps = item_lo[x] - 1, steps + 1
    y, steps = hi, 0
    while y < n and steps < NEIGHBOR_WINDOW and rmq.lcp(hi - 1, y) > floor:
        if bin_of[y] >= 0 and bin_of[y] not in found:
            found.append(bin_of[y])
        y, steps = item_hi[y], steps + 1
    return found


def _shared(b: Bin, lo: int, hi: int, rmq: RangeMin) -> int:
    """Tree tokens saved by adding range [lo, hi) to bin ``b`` (exact trie union)."""
    j = bisect_left(b.starts, lo)
    before = b.ends[j - 1] - 1 if j > 0 else -1  # last sorted position before the item
    after = b.starts[j] if j < len(b.starts) else -1  # first sorted position after it
    saved = rmq.lcp(before, lo) if before >= 0 else 0
    if after >= 0:
        # `after` used to share lcp(before, after) with its predecessor; now it shares
        # lcp(hi - 1, after), which is at least that much.
        saved += rmq.lcp(hi - 1, after) - (rmq.lcp(before, after) if before >= 0 else 0)
    return saved


def split_for_ranks(bins: list[Bin], dp: int, lens: list[int], rmq: RangeMin) -> list[Bin]:
    """Split the biggest bins until every rank can get the same number of micro-batches."""
    target = max(1, math.ceil(len(bins) / dp)) * dp
    while len(bins) < target:
        splittable = [b for b in bins if len(b.starts) > 1 or (b.starts and b.ends[0] - b.starts[0] > 1)]
        if not splittable:
            bins.append(Bin(starts=[], ends=[], cost=0))  # an empty tree, one alignment unit long
            continue
        big = max(splittable, key=lambda b: b.cost)
        bins.remove(big)
        bins.extend(_halve(big, lens, rmq))
    return bins


def _halve(b: Bin, lens: list[int], rmq: RangeMin) -> list[Bin]:
    positions = [k for s, e in zip(b.starts, b.ends, strict=True) for k in range(s, e)]
    added = [lens[positions[0]]] + [
        lens[positions[j]] - rmq.lcp(positions[j - 1], positions[j]) for j in range(1, len(positions))
    ]
    total = sum(added)
    best_j, best_key, left = 1, None, 0
    for j in range(1, len(positions)):
        left += added[j - 1]
        right = total - left + (lens[positions[j]] - added[j])
        key = max(left, right)
        if best_key is None or key < best_key:
            best_j, best_key = j, key
    halves = []
    for part in (positions[:best_j], positions[best_j:]):
        starts, ends = [part[0]], [part[0] + 1]
        for k in part[1:]:
            if k == ends[-1]:
                ends[-1] = k + 1
            else:
                starts.append(k)
                ends.append(k + 1)
        cost = lens[part[0]] + sum(lens[part[j]] - rmq.lcp(part[j - 1], part[j]) for j in range(1, len(part)))
        halves.append(Bin(starts=starts, ends=ends, cost=cost))
    return halves


def assign_ranks(bins: list[Bin], dp: int) -> tuple[tuple[int, ...], ...]:
    """Largest bins first, each to the least-loaded rank that still has room; equal counts."""
    per_rank = len(bins) // dp
    loads = [0] * dp
    ranks: list[list[int]] = [[] for _ in range(dp)]
    for i in sorted(range(len(bins)), key=lambda i: (-bins[i].cost, i)):
        r = min((r for r in range(dp) if len(ranks[r]) < per_rank), key=lambda r: (loads[r], r))
        ranks[r].append(i)
        loads[r] += bins[i].cost
    return tuple(tuple(r) for r in ranks)
