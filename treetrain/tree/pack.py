"""Prefix-aware packing of token sequences into trees, balanced across data-parallel ranks.

The policy, in order (all plain Python, deterministic for the same input):

1. Sort the sequences into trie order and take adjacent common prefixes
   (:func:`treetrain.tree.trie.trie_order`).
2. Cut the sorted list into *items*: maximal subtrees whose tree tokens fit in
   ``max_tokens_per_mb``. A subtree too big is cut at its branch point into its children,
   each child carrying its own copy of the shared prefix. Sequences that share a prefix
   therefore stay together whenever they fit together.
3. Best-fit decreasing over items, with exact sharing: an item goes to the bin where it
   adds the fewest new tree tokens (its prefix shared with sequences already there is
   free), ties to the fullest bin. Sharing is computed exactly for the bins that hold
   sequences near the item in trie order (``bins.NEIGHBOR_WINDOW`` items each side); other bins are
   judged by capacity alone, so the work stays O(items * (window + log bins)). Capacity
   counts tree tokens.
4. Balance across ``dp_size`` ranks: every rank must run the same number of micro-batches,
   so the biggest splittable bins are split in two (at the point that best halves their
   tokens) until the count divides evenly; only when nothing can be split does a rank get
   an empty tree, and that tree is one alignment unit long, not ``max_tokens_per_mb``.
   Then bins go to ranks largest first, each to the rank with the least work so far.
5. Lay each bin out (:func:`treetrain.tree.layout.layout_tree`), padded to a multiple of
   ``lcm(block_size, parallel_size)`` (or to ``max_tokens_per_mb`` with ``pad_to_max``).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from treetrain.tree.bins import Bin, RangeMin, assign_ranks, best_fit, cut_items, split_for_ranks
from treetrain.tree.layout import PackedTree, layout_tree
from treetrain.tree.trie import trie_order

T = TypeVar("T")


# The one attention block size default: the config's blockSize, packing, and log-probs outside a trainer.
DEFAULT_BLOCK_SIZE = 128


class PackingError(ValueError):
    """Bad packing input or configuration; the message says what to change."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackConfig:
    """How to pack. ``max_tokens_per_mb`` counts tree tokens (unique tokens) per micro-batch."""

    max_tokens_per_mb: int
    block_size: int = DEFAULT_BLOCK_SIZE
    parallel_size: int = 1
    dp_size: int = 1
    pad_to_max: bool = False
    # False packs the same sequences flat (no sharing): the baseline that trees are measured against.
    share_prefixes: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "parallel_size", "dp_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise PackingError(f"{name} must be a positive integer, got {value!r}")
        cap = self.max_tokens_per_mb
        if cap is None or not _is_int(cap) or cap <= 0:
            raise PackingError(
                f"max_tokens_per_mb must be set to a positive integer for tree packing, got {cap!r}; "
                f"set it to a multiple of {self.alignment}, e.g. {self.alignment * 64}"
            )
        problem = capacity_problem(cap, self.block_size, self.parallel_size)
        if problem:
            raise PackingError(f"max_tokens_per_mb ({cap}) {problem}")

    @property
    def alignment(self) -> int:
        return math.lcm(self.block_size, self.parallel_size)


def capacity_problem(
    cap: int, block_size: int, parallel_size: int, *, names: tuple[str, str] = ("block_size", "parallel_size")
) -> str | None:
    """Why ``cap`` cannot be a micro-batch capacity (it must be a multiple of
    ``lcm(block_size, parallel_size)``), with the nearest values that work; None if it can.
    ``names`` are what the caller's user calls the two sizes."""
    alignment = math.lcm(block_size, parallel_size)
    if cap % alignment == 0:
        return None
    lower = cap // alignment * alignment
    hint = f"{lower} or {lower + alignment}" if lower else f"{lower + alignment}"
    return (
        f"must be a multiple of {alignment} (lcm of {names[0]}={block_size} and {names[1]}={parallel_size}); use {hint}"
    )


@dataclass(frozen=True, slots=True)
class PackStats:
    """Token counts of one packed batch; ``tree_token_ratio`` = tree / original (lower is better)."""

    num_sequences: int
    num_trees: int
    original_tokens: int
    tree_tokens: int
    padded_tokens: int
    max_tokens_per_mb: int
    rank_tree_tokens: tuple[int, ...]

    @property
    def tree_token_ratio(self) -> float:
        return self.tree_tokens / self.original_tokens if self.original_tokens else 1.0

    @property
    def padding_ratio(self) -> float:
        total = self.tree_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "sequences": self.num_sequences,
            "trees": self.num_trees,
            "original_tokens": self.original_tokens,
            "tree_tokens": self.tree_tokens,
            "padded_tokens": self.padded_tokens,
            "tree_token_ratio": round(self.tree_token_ratio, 6),
            "padding_ratio": round(self.padding_ratio, 6),
            "max_tokens_per_mb": self.max_tokens_per_mb,
            "rank_tree_tokens": list(self.rank_tree_tokens),
        }


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """Trees of one batch; rank ``r`` runs ``[trees[i] for i in ranks[r]]`` in that order."""

    trees: tuple[PackedTree, ...]
    ranks: tuple[tuple[int, ...], ...]
    stats: PackStats

    def rank_trees(self, rank: int) -> list[PackedTree]:
        return [self.trees[i] for i in self.ranks[rank]]

    def unpack(self, per_tree: Sequence[Sequence[T]]) -> list[T]:
        """Inverse of the layout order: ``per_tree[t][k]`` belongs to ``trees[t].seq_ids[k]``."""
        out: list[Any] = [None] * self.stats.num_sequences
        for tree, values in zip(self.trees, per_tree, strict=True):
            if len(values) != len(tree.seq_ids):
                raise ValueError(f"expected {len(tree.seq_ids)} values for a tree, got {len(values)}")
            for i, value in zip(tree.seq_ids, values, strict=True):
                out[i] = value
        return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate(sequences: Sequence[Sequence[int]], cap: int) -> list[list[int]] | list[array[int]]:
    # Lists, or arrays when every sequence is one, compare (trie order) and slice in C; a list
    # and an array do not compare, so a mix (or anything else) becomes lists.
    seqs: list[list[int]] | list[array[int]]
    if all(type(s) is array for s in sequences):
        seqs = cast("list[array[int]]", list(sequences))
    else:
        seqs = [s if type(s) is list else list(s) for s in sequences]
    for i, s in enumerate(seqs):
        if not s:
            raise PackingError(f"sequence {i} is empty; every sequence needs at least one token")
        if len(s) > cap:
            raise PackingError(
                f"sequence {i} has {len(s)} tokens, more than max_tokens_per_mb={cap}; "
                "raise max_tokens_per_mb or truncate/split that sequence"
            )
    return seqs


def _as_list(seq: Sequence[int]) -> list[int]:
    return seq if type(seq) is list else list(seq)


def pack(sequences: Sequence[Sequence[int]], config: PackConfig) -> PackedBatch:
    """Pack token sequences into trees of at most ``config.max_tokens_per_mb`` tree tokens."""
    seqs, plan = _plan(sequences, config)
    trees: list[PackedTree] = []
    for b, padded in zip(plan.bins, plan.padded_lens, strict=True):
        positions = [k for s, e in zip(b.starts, b.ends, strict=True) for k in range(s, e)]
        members = [_as_list(seqs[plan.order[k]]) for k in positions]
        member_lcp = [0] + [plan.rmq.lcp(positions[j - 1], positions[j]) for j in range(1, len(positions))]
        tree = layout_tree(members, [plan.order[k] for k in positions], member_lcp, padded)
        assert tree.num_tokens == b.cost, (tree.num_tokens, b.cost)
        trees.append(tree)
    return PackedBatch(trees=tuple(trees), ranks=plan.ranks, stats=plan.stats)


def pack_stats(sequences: Sequence[Sequence[int]], config: PackConfig) -> PackStats:
    """``pack(sequences, config).stats`` without laying the trees out: the same plan, in memory
    of O(sequences) beyond the input. Sequences may be ``array.array`` rows (4 bytes a token;
    what ``treetrain pack-stats`` reads into), compared in C like lists."""
    return _plan(sequences, config)[1].stats


@dataclass(frozen=True, slots=True)
class _Plan:
    """Which sorted positions go to which tree, and which trees to which rank."""

    order: list[int]
    rmq: RangeMin
    bins: list[Bin]
    ranks: tuple[tuple[int, ...], ...]
    padded_lens: list[int]
    stats: PackStats


def _plan(sequences: Sequence[Sequence[int]], config: PackConfig) -> tuple[list[list[int]] | list[array[int]], _Plan]:
    cap = config.max_tokens_per_mb
    seqs = _validate(sequences, cap)
    n = len(seqs)
    order, lcp = trie_order(seqs)
    if not config.share_prefixes:
        lcp = [0] * n
    lens = [len(seqs[i]) for i in order]
    # prefix[k] = sum over j < k of the tokens sorted sequence j adds after j - 1
    prefix = [0] * (n + 1)
    for k in range(n):
        prefix[k + 1] = prefix[k] + lens[k] - lcp[k]

    def range_cost(lo: int, hi: int) -> int:
        return lens[lo] + prefix[hi] - prefix[lo + 1]

    items = cut_items(n, lcp, cap, range_cost)
    rmq = RangeMin(lcp)
    bins = best_fit(items, cap, range_cost, rmq, n)
    bins = split_for_ranks(bins, config.dp_size, lens, rmq)
    ranks = assign_ranks(bins, config.dp_size)
    # A tree's tokens are its bin's cost (pack checks it against the layout).
    padded = [
        cap if config.pad_to_max else max(1, math.ceil(b.cost / config.alignment)) * config.alignment for b in bins
    ]
    tree_tokens = sum(b.cost for b in bins)
    stats = PackStats(
        num_sequences=n,
        num_trees=len(bins),
        original_tokens=sum(lens),
        tree_tokens=tree_tokens,
        padded_tokens=sum(padded) - tree_tokens,
        max_tokens_per_mb=cap,
        rank_tree_tokens=tuple(sum(bins[i].cost for i in r) for r in ranks),
    )
    return seqs, _Plan(order=order, rmq=rmq, bins=bins, ranks=ranks, padded_lens=padded, stats=stats)
