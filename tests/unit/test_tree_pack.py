"""Packing: layout, node metadata, the token_end mask rule, policy, validation, DP balancing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_helpers import reference_mask, token_parents

from treetrain.tree import PackConfig, PackedBatch, PackedTree, PackingError, common_prefix, pack


def _check_tree(tree: PackedTree, seqs: list[list[int]], config: PackConfig) -> None:
    assert tree.num_tokens <= config.max_tokens_per_mb
    assert tree.padded_len % config.alignment == 0
    assert len(tree.input_ids) == len(tree.position_ids) == len(tree.token_end) == tree.padded_len
    for k, i in enumerate(tree.seq_ids):
        idx = tree.sequence_tokens(k)
        assert [tree.input_ids[t] for t in idx] == seqs[i]
        assert [tree.position_ids[t] for t in idx] == list(range(len(seqs[i])))
        assert idx == sorted(idx)
        # consecutive tokens of a sequence are parent -> child in the tree
        parents = token_parents(tree)
        assert [parents[t] for t in idx] == [-1, *idx[:-1]]
    # tree tokens = distinct prefixes of its sequences (each trie node is one token)
    prefixes = {tuple(seqs[i][: d + 1]) for i in tree.seq_ids for d in range(len(seqs[i]))}
    assert tree.num_tokens == len(prefixes)
    # the O(N) rule reproduces the ancestor mask exactly
    ref = reference_mask(tree)
    for i in range(tree.padded_len):
        row = [j <= i < tree.token_end[j] for j in range(tree.padded_len)]
        assert row == ref[i], f"row {i}"


def _check_batch(batch: PackedBatch, seqs: list[list[int]], config: PackConfig) -> None:
    seen = sorted(i for t in batch.trees for i in t.seq_ids)
    assert seen == list(range(len(seqs)))
    assert sorted(i for r in batch.ranks for i in r) == list(range(len(batch.trees)))
    assert len({len(r) for r in batch.ranks}) == 1, "every rank runs the same number of micro-batches"
    assert len(batch.ranks) == config.dp_size
    for tree in batch.trees:
        _check_tree(tree, seqs, config)
    stats = batch.stats
    assert stats.original_tokens == sum(map(len, seqs))
    assert stats.tree_tokens == sum(t.num_tokens for t in batch.trees)
    assert stats.padded_tokens == sum(t.padded_len for t in batch.trees) - stats.tree_tokens


def test_worked_example() -> None:
    a, b, c, d, e, f, g, h = range(1, 9)
    seqs = [[a, b, c, d], [a, b, e, f], [a, g, h]]
    batch = pack(seqs, PackConfig(max_tokens_per_mb=128))
    (tree,) = batch.trees
    assert tree.input_ids[:8] == [a, b, c, d, e, f, g, h]
    assert tree.position_ids[:8] == [0, 1, 2, 3, 2, 3, 1, 2]
    assert token_parents(tree) == [-1, 0, 1, 2, 1, 4, 0, 6]
    assert (tree.node_start, tree.node_end, tree.node_parent) == ([0, 1, 2, 4, 6], [1, 2, 4, 6, 8], [-1, 0, 1, 1, 0])
    assert batch.stats.tree_token_ratio == pytest.approx(8 / 11)
    assert tree.padded_len == 128 and batch.stats.padded_tokens == 120
    _check_batch(batch, seqs, PackConfig(max_tokens_per_mb=128))


@pytest.mark.parametrize(
    "seqs",
    [
        [[1, 2, 3], [1, 2, 3], [1, 2, 3]],  # exact duplicates
        [[1, 2], [1, 2, 3, 4], [1], [1, 2, 3]],  # prefixes of each other
        [[5], [6], [5], [7, 1]],  # single tokens, no sharing
        [[1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 9], [1, 2, 3, 4]],
        [[3, 1], [1, 3], [2]],  # a forest of roots
    ],
)
def test_special_shapes(seqs: list[list[int]]) -> None:
    config = PackConfig(max_tokens_per_mb=16, block_size=4)
    _check_batch(pack(seqs, config), seqs, config)


def test_duplicates_and_prefixes_add_no_tokens() -> None:
    p = list(range(1, 40))
    batch = pack([p, p, p[:10], p[:1], p], PackConfig(max_tokens_per_mb=128))
    assert batch.stats.tree_tokens == 39
    assert batch.stats.num_trees == 1


def test_node_breaks_where_a_sequence_ends() -> None:
    batch = pack([[1, 2, 3, 4], [1, 2]], PackConfig(max_tokens_per_mb=8, block_size=4))
    (tree,) = batch.trees
    assert (tree.node_start, tree.node_end, tree.node_parent) == ([0, 2], [2, 4], [-1, 0])


def _grpo(rng: random.Random, groups: int, prompt: int, response: int, n: int) -> list[list[int]]:
    seqs = []
    for _ in range(groups):
        pr = [rng.randrange(1, 1000) for _ in range(prompt)]
        seqs += [pr + [rng.randrange(1, 1000) for _ in range(response)] for _ in range(n)]
    rng.shuffle(seqs)
    return seqs


def test_groups_stay_together_and_fill_trees() -> None:
    seqs = _grpo(random.Random(0), groups=6, prompt=100, response=50, n=4)  # each group: 300 tree tokens
    batch = pack(seqs, PackConfig(max_tokens_per_mb=640, block_size=64))
    # prefix-aware: two whole groups per tree, no prompt stored twice
    assert batch.stats.num_trees == 3
    assert batch.stats.tree_tokens == 6 * 300
    for tree in batch.trees:
        prompts = {tuple(seqs[i][:100]) for i in tree.seq_ids}
        assert len(prompts) == 2


def test_first_fit_trap_is_avoided() -> None:
    # AReaL's batch-order first fit makes trees [1000, 800] here; prefix-aware packing makes [900, 400].
    rng = random.Random(1)
    p = [rng.randrange(1, 99) for _ in range(500)]
    a = p + [rng.randrange(100, 199) for _ in range(100)]
    b = [rng.randrange(200, 299) for _ in range(400)]
    c = p + [rng.randrange(300, 399) for _ in range(300)]
    batch = pack([a, b, c], PackConfig(max_tokens_per_mb=1024))
    assert sorted(t.num_tokens for t in batch.trees) == [400, 900]


def test_oversized_group_is_split_at_its_branch_point() -> None:
    rng = random.Random(2)
    seqs = _grpo(rng, groups=1, prompt=60, response=40, n=8)  # 380 tree tokens, cap 256
    config = PackConfig(max_tokens_per_mb=256, block_size=32)
    batch = pack(seqs, config)
    assert batch.stats.num_trees == 2
    assert batch.stats.tree_tokens == 380 + 60  # the prompt appears once per tree
    _check_batch(batch, seqs, config)


def test_deterministic() -> None:
    seqs = _grpo(random.Random(3), groups=5, prompt=30, response=20, n=3)
    config = PackConfig(max_tokens_per_mb=128, block_size=16, dp_size=3)
    assert pack(seqs, config) == pack([list(s) for s in seqs], config)


def test_pad_to_max() -> None:
    batch = pack([[1, 2, 3]], PackConfig(max_tokens_per_mb=256, pad_to_max=True))
    assert batch.trees[0].padded_len == 256


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens_per_mb": None}, "must be set to a positive integer"),
        ({"max_tokens_per_mb": 0}, "must be set to a positive integer"),
        ({"max_tokens_per_mb": -128}, "must be set to a positive integer"),
        ({"max_tokens_per_mb": True}, "must be set to a positive integer"),
        ({"max_tokens_per_mb": 300}, r"multiple of 128 \(lcm of block_size=128 and parallel_size=1\); use 256 or 384"),
        ({"max_tokens_per_mb": 256, "parallel_size": 3}, r"multiple of 384 .*use 384"),
        ({"max_tokens_per_mb": 256, "block_size": 0}, "block_size must be a positive integer"),
        ({"max_tokens_per_mb": 256, "dp_size": 0}, "dp_size must be a positive integer"),
    ],
)
def test_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PackingError, match=message):
        PackConfig(**kwargs)  # type: ignore[arg-type]


def test_sequence_errors_name_the_sequence() -> None:
    config = PackConfig(max_tokens_per_mb=128)
    with pytest.raises(PackingError, match="sequence 1 has 129 tokens, more than max_tokens_per_mb=128"):
        pack([[1], [2] * 129], config)
    with pytest.raises(PackingError, match="sequence 2 is empty"):
        pack([[1], [2], []], config)


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_ranks_are_balanced(dp: int) -> None:
    seqs = _grpo(random.Random(dp), groups=7, prompt=50, response=30, n=5)
    config = PackConfig(max_tokens_per_mb=512, block_size=32, dp_size=dp)
    batch = pack(seqs, config)
    _check_batch(batch, seqs, config)
    loads = batch.stats.rank_tree_tokens
    assert max(loads) <= 1.5 * (sum(loads) / dp) + 512 / 4
    # no rank gets an empty tree while another rank's tree could have been split
    assert all(t.seq_ids for t in batch.trees)


def test_empty_trees_only_when_nothing_can_split() -> None:
    config = PackConfig(max_tokens_per_mb=128, block_size=32, dp_size=4)
    batch = pack([[1, 2, 3], [1, 2, 4]], config)
    _check_batch(batch, [[1, 2, 3], [1, 2, 4]], config)
    empty = [t for t in batch.trees if not t.seq_ids]
    assert len(empty) == 2
    assert all(t.padded_len == 32 for t in empty), "an empty tree is one alignment unit, not max_tokens_per_mb"


def test_unpack_restores_input_order() -> None:
    seqs = [[1, 2, 3], [4, 5], [1, 2, 6, 7]]
    batch = pack(seqs, PackConfig(max_tokens_per_mb=128))
    values = [[f"s{i}t{j}" for j in range(len(s))] for i, s in enumerate(seqs)]
    tree = batch.trees[0]
    per_seq = [values[i] for i in tree.seq_ids]  # layout order
    assert batch.unpack([per_seq]) == values


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(30))]
        b = [rng.randrange(3) for _ in range(rng.randrange(30))]
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        assert common_prefix(a, b) == k


# Random tries: sequences drawn as walks in a small random trie, so prefixes, siblings,
# duplicates and single tokens all occur.
@st.composite
def tries(draw: st.DrawFn) -> list[list[int]]:
    n = draw(st.integers(1, 12))
    seqs: list[list[int]] = []
    for _ in range(n):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            cut = draw(st.integers(0, len(base)))
            tail = draw(st.lists(st.integers(1, 4), max_size=10))
            seq = base[:cut] + tail
        else:
            seq = draw(st.lists(st.integers(1, 4), max_size=14))
        seqs.append(seq or [draw(st.integers(1, 4))])
    return seqs


@settings(max_examples=150, deadline=None)
@given(seqs=tries(), cap_blocks=st.integers(1, 6), block=st.sampled_from([4, 8]), dp=st.integers(1, 3))
def test_property_random_tries(seqs: list[list[int]], cap_blocks: int, block: int, dp: int) -> None:
    cap = max(cap_blocks * block, -(-max(map(len, seqs)) // block) * block)
    config = PackConfig(max_tokens_per_mb=cap, block_size=block, dp_size=dp)
    batch = pack(seqs, config)
    _check_batch(batch, seqs, config)
    # never worse than no sharing, never better than the union trie
    union = len({tuple(s[: d + 1]) for s in seqs for d in range(len(s))})
    assert union <= batch.stats.tree_tokens <= batch.stats.original_tokens
    if dp == 1 and union <= cap:
        assert batch.stats.num_trees == 1 and batch.stats.tree_tokens == union
