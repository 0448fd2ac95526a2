"""`flex` and `triton` tree attention against `dense`.

On CPU (CI): `triton` runs its real kernels under Triton's interpreter (TRITON_INTERPRET=1,
set here before the kernels are first imported), forward and gradients, fp32, small
shapes; `flex` runs FlexAttention's forward (CPU has no FlexAttention backward; `flex`
says so). With TREETRAIN_TEST_DEVICE=cuda (bench/gpu.sh) the same tests run compiled on
the GPU, and `flex` is checked with gradients too.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch
from tree_helpers import one_tree, tiny_model

from treetrain.attention import BackendUnavailableError, TreeAttentionMeta, dense_attention, resolve
from treetrain.attention.blocks import block_sparsity
from treetrain.attention.flex import FlexUnavailableError, flex_attention, tree_block_mask
from treetrain.attention.triton_tree import TritonUnavailableError, check_available, triton_attention
from treetrain.logprob import tree_logprobs
from treetrain.tree import PackedTree

BLOCK = 16  # the smallest block Triton's tl.dot takes
DEVICE = torch.device(os.environ.get("TREETRAIN_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    # Read when treetrain first imports its Triton kernels (lazily, at the first triton call).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _tree(seqs: list[list[int]], block: int = BLOCK) -> PackedTree:
    return one_tree(seqs, block)


def _meta(tree: PackedTree, backend: str, block: int = BLOCK) -> TreeAttentionMeta:
    return TreeAttentionMeta.from_tree(tree, backend=backend, block_size=block, device=DEVICE)


def _qkv(n: int, heads: int = 4, kv_heads: int = 2, dim: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(h, n, dim, generator=g).to(DEVICE) for h in (heads, kv_heads, kv_heads)]


def _random_trie(rng: random.Random, n_seqs: int, max_len: int) -> list[list[int]]:
    """Siblings, sequences that are prefixes of others, and exact duplicates."""
    seqs: list[list[int]] = []
    for _ in range(n_seqs):
        roll = rng.random()
        if seqs and roll < 0.15:
            seqs.append(list(rng.choice(seqs)))  # duplicate
        elif seqs and roll < 0.3:
            base = rng.choice(seqs)
            seqs.append(base[: rng.randrange(1, len(base) + 1)])  # prefix of another
        elif seqs and roll < 0.8:
            base = rng.choice(seqs)
            cut = rng.randrange(len(base) + 1)
            seqs.append(base[:cut] + [rng.randrange(1, 60) for _ in range(rng.randrange(1, max_len))])
        else:
            seqs.append([rng.randrange(1, 60) for _ in range(rng.randrange(1, max_len))])
    return seqs


def _branch_at_every_offset(offsets: range) -> list[list[int]]:
    """One chain and, for every offset o, a child that shares exactly its first o tokens:
    the last shared token sits at every position of the 64-token words AReaL's kernel
    packs its mask into (57-63 included) and at every block boundary."""
    base = list(range(1000, 1000 + offsets.stop + 9))
    return [base] + [base[:o] + [2000 + 3 * o + i for i in range(3)] for o in offsets]


def _check_triton(tree: PackedTree, *, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> None:
    _check_with_gradients(triton_attention, "triton", tree, heads=heads, kv_heads=kv_heads, seed=seed)
    if DEVICE.type == "cuda":
        _check_with_gradients(flex_attention, "flex", tree, heads=heads, kv_heads=kv_heads, seed=seed)


def _check_with_gradients(fn: Any, backend: str, tree: PackedTree, *, heads: int, kv_heads: int, seed: int) -> None:
    q, k, v = _qkv(tree.padded_len, heads, kv_heads, seed=seed)
    scale = q.shape[-1] ** -0.5
    g = torch.Generator().manual_seed(seed + 1)
    weights = torch.randn(heads, tree.padded_len, q.shape[-1], generator=g).to(DEVICE)
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    dense = dense_attention(qd, kd, vd, _meta(tree, "dense"), scale)
    grads_dense = torch.autograd.grad((dense * weights).sum(), (qd, kd, vd))
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    fused = fn(qt, kt, vt, _meta(tree, backend), scale)
    grads_fused = torch.autograd.grad((fused * weights).sum(), (qt, kt, vt))
    torch.testing.assert_close(fused, dense, atol=1e-5, rtol=1e-5)
    for name, gf, gd in zip("qkv", grads_fused, grads_dense, strict=True):
        torch.testing.assert_close(gf, gd, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


# ---------------------------------------------------------------------------
# triton


@pytest.mark.parametrize("seed", range(3))
def test_triton_matches_dense_on_random_tries(seed: int) -> None:
    _check_triton(_tree(_random_trie(random.Random(seed), 9, 30)), seed=seed)


def test_triton_multi_query_and_single_token_sequences() -> None:
    seqs = [[5], [5], [5, 6], [7], [5, 6, 7, 8, 9] * 5, [1, 2, 3]]
    _check_triton(_tree(seqs), heads=4, kv_heads=1)


@pytest.mark.slow
def test_triton_branch_at_every_offset() -> None:
    # Offsets 0-130 cover 57-63 of the first 64-token word (121-127 of the second) and
    # every boundary of 16-token blocks.
    _check_triton(_tree(_branch_at_every_offset(range(0, 131))), heads=2, kv_heads=1)


def test_tree_logprobs_with_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREETRAIN_BLOCK_SIZE", str(BLOCK))
    model = tiny_model("qwen3").to(DEVICE)
    seqs = _random_trie(random.Random(7), 6, 14)
    dense = tree_logprobs(model, seqs, max_tokens_per_mb=128, attention="dense")
    fused = tree_logprobs(model, seqs, max_tokens_per_mb=128, attention="triton")
    for a, b in zip(fused, dense, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Gradients flow through the kernels into the model.
    sum(lp.sum() for lp in fused).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------------------
# flex


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block", [16, 32])
def test_flex_forward_matches_dense(seed: int, block: int) -> None:
    tree = _tree(_random_trie(random.Random(seed), 10, 30), block)
    q, k, v = _qkv(tree.padded_len, seed=seed)
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        flex = flex_attention(q, k, v, _meta(tree, "flex", block), scale)
        dense = dense_attention(q, k, v, _meta(tree, "dense", block), scale)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_flex_branch_at_every_offset() -> None:
    tree = _tree(_branch_at_every_offset(range(0, 131)))
    q, k, v = _qkv(tree.padded_len)
    with torch.no_grad():
        flex = flex_attention(q, k, v, _meta(tree, "flex"), 0.25)
        dense = dense_attention(q, k, v, _meta(tree, "dense"), 0.25)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_flex_refuses_gradients_on_cpu() -> None:
    tree = _tree([[1, 2, 3], [1, 2, 4]])
    q, k, v = (t.cpu().requires_grad_() for t in _qkv(tree.padded_len))
    meta = TreeAttentionMeta.from_tree(tree, backend="flex", block_size=BLOCK, device=torch.device("cpu"))
    with pytest.raises(FlexUnavailableError, match=r"no backward on cpu.*attention='sparse'"):
        flex_attention(q, k, v, meta, 0.25)


def test_flex_block_mask_is_built_from_block_metadata() -> None:
    tree = _tree(_random_trie(random.Random(3), 12, 40))
    meta = _meta(tree, "flex")
    mask = tree_block_mask(meta)
    assert tree_block_mask(meta) is mask  # built once per micro-batch, shared by all layers
    dense_NN = meta.dense_mask()
    nb = tree.padded_len // BLOCK
    blocks_nnBB = dense_NN.view(nb, BLOCK, nb, BLOCK).permute(0, 2, 1, 3)
    live_nn, full_nn = blocks_nnBB.any(-1).any(-1), blocks_nnBB.all(-1).all(-1)
    partial = {(q, int(k)) for q in range(nb) for k in mask.kv_indices[0, 0, q, : mask.kv_num_blocks[0, 0, q]]}
    full = {(q, int(k)) for q in range(nb) for k in mask.full_kv_indices[0, 0, q, : mask.full_kv_num_blocks[0, 0, q]]}
    assert partial | full == {tuple(p) for p in live_nn.nonzero().tolist()}
    assert full == {tuple(p) for p in full_nn.nonzero().tolist()} and not partial & full


def test_block_sparsity_csr() -> None:
    tree = _tree(_random_trie(random.Random(5), 12, 40))
    meta = _meta(tree, "triton")
    s = block_sparsity(meta)
    nb = tree.padded_len // BLOCK
    dense_NN = meta.dense_mask()
    live_nn = dense_NN.view(nb, BLOCK, nb, BLOCK).any(3).any(1)
    for qb in range(nb):
        row = s.kv_idx_P[s.kv_ptr_n1[qb] : s.kv_ptr_n1[qb + 1]].tolist()
        assert row == live_nn[qb].nonzero().flatten().tolist()
    for kb in range(nb):  # the query blocks that see key block kb are kb .. last_q[kb], no gaps
        seen = live_nn[:, kb].nonzero().flatten().tolist()
        assert seen == list(range(kb, int(s.last_q_n[kb]) + 1))


# ---------------------------------------------------------------------------
# selection


def test_auto_picks_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREETRAIN_ATTENTION", "triton")  # resolve reads no environment
    assert resolve("auto", torch.device("cpu")) == "sparse"
    assert resolve("auto", torch.device("cuda")) == "flex"


def test_explicit_choices_that_cannot_work_fail_early(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(BackendUnavailableError, match="'flex' has no backward on cpu"):
        resolve("flex", cpu, needs_grad=True)
    assert resolve("flex", cpu) == "flex"  # forward-only use is fine
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match=r"needs a CUDA GPU.*TRITON_INTERPRET=1"):
        resolve("triton", cpu)
    with pytest.raises(TritonUnavailableError):
        check_available(cpu)
    assert resolve("triton", torch.device("cuda")) == "triton"
