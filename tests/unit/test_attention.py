"""Tree attention: `dense` against a from-first-principles reference, `sparse` against `dense`."""

from __future__ import annotations

import random
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_helpers import one_tree, reference_mask, tiny_model

from treetrain.attention import (
    IMPLEMENTATION,
    NAMES,
    TreeAttentionMeta,
    UnknownBackendError,
    dense_attention,
    register,
    registry,
    resolve,
    sparse_attention,
    tree_attention_forward,
    tree_forward,
)
from treetrain.config.schema import AttentionName
from treetrain.logprob import tree_logprobs
from treetrain.tree import PackedTree


def _tree(seqs: list[list[int]], block: int) -> PackedTree:
    return one_tree(seqs, block)


def _qkv(n: int, h: int = 4, kh: int = 2, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(heads, n, d, generator=g, dtype=torch.float64) for heads in (h, kh, kh))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree: PackedTree) -> torch.Tensor:
    """Masked softmax written out, with the mask from walking parent pointers."""
    mask = torch.tensor(reference_mask(tree))
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def _meta(tree: PackedTree, backend: str, block: int) -> TreeAttentionMeta:
    return TreeAttentionMeta.from_tree(tree, backend=backend, block_size=block, device=torch.device("cpu"))


def _branchy(rng: random.Random, n_seqs: int, max_len: int) -> list[list[int]]:
    seqs: list[list[int]] = []
    for _ in range(n_seqs):
        if seqs and rng.random() < 0.7:
            base = rng.choice(seqs)
            cut = rng.randrange(len(base) + 1)
            seqs.append(base[:cut] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, max_len))])
        else:
            seqs.append([rng.randrange(1, 50) for _ in range(rng.randrange(1, max_len))])
    return seqs


@pytest.mark.parametrize("seed", range(4))
def test_dense_matches_reference(seed: int) -> None:
    tree = _tree(_branchy(random.Random(seed), 8, 20), block=8)
    q, k, v = _qkv(tree.padded_len, seed=seed)
    out = dense_attention(q, k, v, _meta(tree, "dense", 8), q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, _reference(q, k, v, tree))


def _sparse_vs_dense(tree: PackedTree, block: int, seed: int = 0) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(tree.padded_len, seed=seed))
    scale = q.shape[-1] ** -0.5
    dense = dense_attention(q, k, v, _meta(tree, "dense", block), scale)
    grads_dense = torch.autograd.grad((dense * dense.detach().cos()).sum(), (q, k, v))
    sparse = sparse_attention(q, k, v, _meta(tree, "sparse", block), scale)
    grads_sparse = torch.autograd.grad((sparse * dense.detach().cos()).sum(), (q, k, v))
    torch.testing.assert_close(sparse, dense)
    for gs, gd in zip(grads_sparse, grads_dense, strict=True):
        torch.testing.assert_close(gs, gd)


@pytest.mark.parametrize("block", [4, 8, 16])
@pytest.mark.parametrize("seed", range(3))
def test_sparse_matches_dense_with_gradients(block: int, seed: int) -> None:
    _sparse_vs_dense(_tree(_branchy(random.Random(seed), 10, 24), block=block), block, seed)


@pytest.mark.parametrize("prompt", range(1, 2 * 8 + 3))
def test_branch_point_at_every_offset_across_blocks(prompt: int) -> None:
    # The branch sits at every offset of the first three blocks; the children straddle boundaries.
    block = 8
    base = list(range(1, prompt + 1))
    seqs = [base + [100 + i for i in range(11)], base + [200 + i for i in range(5)], base[: max(1, prompt - 3)]]
    _sparse_vs_dense(_tree(seqs, block=block), block)


def test_live_pairs_are_exactly_the_nonempty_blocks() -> None:
    block = 4
    tree = _tree(_branchy(random.Random(7), 12, 15), block=block)
    meta = _meta(tree, "sparse", block)
    nb = tree.padded_len // block
    blocks = meta.dense_mask().view(nb, block, nb, block).any(dim=3).any(dim=1)
    qb, kb = meta.live_pairs()
    got = torch.zeros(nb, nb, dtype=torch.bool)
    got[qb, kb] = True
    assert torch.equal(got, blocks)
    assert len(set(zip(qb.tolist(), kb.tolist(), strict=True))) == qb.shape[0]
    assert 0 < meta.live_fraction() < 1


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), block=st.sampled_from([2, 4, 8]))
def test_property_sparse_equals_dense_on_random_tries(seed: int, block: int) -> None:
    _sparse_vs_dense(_tree(_branchy(random.Random(seed), 6, 12), block=block), block, seed)


def test_resolve() -> None:
    assert resolve("dense") == "dense"
    assert resolve("sparse") == "sparse"
    assert set(NAMES) == {"auto", "flex", "triton", "sparse", "dense"}
    assert get_args(AttentionName) == NAMES  # one list: the config's
    with pytest.raises(UnknownBackendError, match="valid: auto, flex, triton, sparse, dense"):
        resolve("flash")
    assert resolve("flex") == "flex"  # selection by device: tests/unit/test_attention_fused.py


def test_resolve_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREETRAIN_ATTENTION", "dense")
    assert resolve("auto") == "sparse"
    assert resolve("auto", torch.device("cpu")) == "sparse"
    assert not hasattr(registry, "block_size")


def test_tree_logprobs_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The public entry point reads TREETRAIN_ATTENTION (for auto) and TREETRAIN_BLOCK_SIZE."""
    model = tiny_model("llama")
    seqs = [[1, 2, 3, 4], [1, 2, 5]]
    monkeypatch.setenv("TREETRAIN_BLOCK_SIZE", "16")
    monkeypatch.setenv("TREETRAIN_ATTENTION", "bogus")
    with pytest.raises(UnknownBackendError, match="'bogus'"):
        tree_logprobs(model, seqs, max_tokens_per_mb=32)
    monkeypatch.setenv("TREETRAIN_ATTENTION", "dense")
    dense = tree_logprobs(model, seqs, max_tokens_per_mb=32)  # auto -> the environment's dense
    sparse = tree_logprobs(model, seqs, max_tokens_per_mb=32, attention="sparse")  # an explicit choice wins
    for a, b in zip(dense, sparse, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    monkeypatch.setenv("TREETRAIN_BLOCK_SIZE", "24")
    with pytest.raises(ValueError, match="multiple of 24"):
        tree_logprobs(model, seqs, max_tokens_per_mb=32)
    monkeypatch.setenv("TREETRAIN_BLOCK_SIZE", "x")
    with pytest.raises(ValueError, match="TREETRAIN_BLOCK_SIZE must be a positive integer, got 'x'"):
        tree_logprobs(model, seqs, max_tokens_per_mb=32)


def _call(meta: TreeAttentionMeta | None, **kwargs: object) -> torch.Tensor:
    q, k, v = (t.float()[None] for t in _qkv(meta.num_tokens if meta else 8))
    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    return tree_attention_forward(module, q, k, v, kwargs.pop("attention_mask", None), tree_attention=meta, **kwargs)[0]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sliding_window": 4096}, "sliding_window=4096"),
        ({"softcap": 30.0}, "softcap=30.0"),
        ({"s_aux": torch.zeros(4)}, "s_aux"),
        ({"dropout": 0.1}, "attention dropout"),
        ({"output_attentions": True}, "output_attentions=True"),
        ({"attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool)}, "builds its own mask"),
    ],
)
def test_unsupported_kwargs_are_refused(kwargs: dict[str, object], message: str) -> None:
    tree = _tree([[1, 2, 3], [1, 2, 4]], block=8)
    with pytest.raises(ValueError, match=message):
        _call(_meta(tree, "sparse", 8), **kwargs)


def test_benign_kwargs_are_accepted() -> None:
    tree = _tree([[1, 2, 3], [1, 2, 4]], block=8)
    out = _call(_meta(tree, "sparse", 8), sliding_window=None, position_ids=torch.zeros(1, 8), use_cache=False)
    assert out.shape == (1, 8, 4, 8)


def test_outside_a_tree_forward_it_is_sdpa() -> None:
    register()
    model = tiny_model("qwen2")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        model.set_attn_implementation(IMPLEMENTATION)
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="needs tree_attention"), tree_forward(), torch.no_grad():
        model(input_ids=ids, use_cache=False)
