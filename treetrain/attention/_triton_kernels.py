"""Triton kernels for tree attention (see :mod:`treetrain.attention.triton_tree`).

Imported lazily: ``triton.jit`` decides at import time whether to compile for the GPU
or to interpret on the CPU (``TRITON_INTERPRET=1``).

Tensors are contiguous: q/o/do ``[H, N, D]``, k/v ``[K, N, D]``, lse/delta ``[H, N]``
(fp32), token_end ``[N]``. All accumulation is fp32; fp32 inputs multiply in IEEE fp32
(no TF32), so results match the ``dense`` reference to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treetrain.attention.blocks import BlockSparsity


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):  # type: ignore[no-untyped-def]
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tree_mask(offs_q, offs_k, tend):  # type: ignore[no-untyped-def]
    # allowed[i, j] = j <= i < token_end[j]: j is i itself or one of its ancestors.
    return (offs_k[None, :] <= offs_q[:, None]) & (offs_q[:, None] < tend[None, :])


@triton.jit
def _rows(PTR, head, offs, offs_d, N, D):  # type: ignore[no-untyped-def]
    """Rows ``offs`` of head ``head`` of a contiguous ``[heads, N, D]`` tensor (D zero-padded)."""
    return tl.load(PTR + head * N * D + offs[:, None] * D + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)


@triton.jit
def _store_rows(PTR, head, offs, offs_d, N, D, value):  # type: ignore[no-untyped-def]
    ptrs = PTR + head * N * D + offs[:, None] * D + offs_d[None, :]
    tl.store(ptrs, value.to(PTR.dtype.element_ty), mask=offs_d[None, :] < D)


@triton.jit
def _probs(q, k, tend, lse, offs_q, offs_k, scale, IEEE: tl.constexpr):  # type: ignore[no-untyped-def]
    """Softmax probabilities of one block pair, recomputed from the saved log-sum-exp."""
    s = _dot(q, tl.trans(k), IEEE) * scale
    return tl.where(_tree_mask(offs_q, offs_k, tend), tl.exp(s - lse[:, None]), 0.0)


@triton.jit
def _fwd_kernel(  # type: ignore[no-untyped-def]
    Q, K, V, O, LSE, TEND, KV_PTR, KV_IDX, scale, N, D,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    qb = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // GROUP
    offs_q = qb * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    q = _rows(Q, h, offs_q, offs_d, N, D)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    start = tl.load(KV_PTR + qb)
    end = tl.load(KV_PTR + qb + 1)
    for i in range(start, end):
        kb = tl.load(KV_IDX + i)
        offs_k = kb * BLOCK + tl.arange(0, BLOCK)
        k = _rows(K, kh, offs_k, offs_d, N, D)
        v = _rows(V, kh, offs_k, offs_d, N, D)
        tend = tl.load(TEND + offs_k)
        s = _dot(q, tl.trans(k), IEEE) * scale
        s = tl.where(_tree_mask(offs_q, offs_k, tend), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see nothing in this block (another branch): keep exp() away from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    # Every token sees itself, so l_i > 0 for every row, padding included.
    acc = acc / l_i[:, None]
    _store_rows(O, h, offs_q, offs_d, N, D, acc)
    tl.store(LSE + h * N + offs_q, m_i + tl.log(l_i))


@triton.jit
def _bwd_dkdv_kernel(  # type: ignore[no-untyped-def]
    Q, K, V, DO, LSE, DELTA, DK, DV, TEND, LAST_Q, scale, N, D,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    kb = tl.program_id(0)
    kh = tl.program_id(1)
    offs_k = kb * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    k = _rows(K, kh, offs_k, offs_d, N, D)
    v = _rows(V, kh, offs_k, offs_d, N, D)
    tend = tl.load(TEND + offs_k)
    dk = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    last = tl.load(LAST_Q + kb)
    for g in range(GROUP):
        h = kh * GROUP + g
        # The query blocks that see key block kb are exactly kb .. last_q[kb].
        for qb in range(kb, last + 1):
            offs_q = qb * BLOCK + tl.arange(0, BLOCK)
            q = _rows(Q, h, offs_q, offs_d, N, D)
            do = _rows(DO, h, offs_q, offs_d, N, D)
            lse = tl.load(LSE + h * N + offs_q)
            delta = tl.load(DELTA + h * N + offs_q)
            p = _probs(q, k, tend, lse, offs_q, offs_k, scale, IEEE)
            dv += _dot(tl.trans(p).to(do.dtype), do, IEEE)
            dp = _dot(do, tl.trans(v), IEEE)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds).to(q.dtype), q, IEEE)
    _store_rows(DK, kh, offs_k, offs_d, N, D, dk * scale)
    _store_rows(DV, kh, offs_k, offs_d, N, D, dv)


@triton.jit
def _bwd_dq_kernel(  # type: ignore[no-untyped-def]
    Q, K, V, DO, LSE, DELTA, DQ, TEND, KV_PTR, KV_IDX, scale, N, D,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    qb = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // GROUP
    offs_q = qb * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    q = _rows(Q, h, offs_q, offs_d, N, D)
    do = _rows(DO, h, offs_q, offs_d, N, D)
    lse = tl.load(LSE + h * N + offs_q)
    delta = tl.load(DELTA + h * N + offs_q)
    dq = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    start = tl.load(KV_PTR + qb)
    end = tl.load(KV_PTR + qb + 1)
    for i in range(start, end):
        kb = tl.load(KV_IDX + i)
        offs_k = kb * BLOCK + tl.arange(0, BLOCK)
        k = _rows(K, kh, offs_k, offs_d, N, D)
        v = _rows(V, kh, offs_k, offs_d, N, D)
        p = _probs(q, k, tl.load(TEND + offs_k), lse, offs_q, offs_k, scale, IEEE)
        dp = _dot(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)
    _store_rows(DQ, h, offs_q, offs_d, N, D, dq * scale)


def _shapes(q_HND: torch.Tensor, k_KND: torch.Tensor, block: int) -> tuple[int, int, int, int, int]:
    h, n, d = q_HND.shape
    kh = k_KND.shape[0]
    if h % kh:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({kh})")
    if n % block:
        raise ValueError(f"tree length {n} is not a multiple of the block size {block}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"the triton backend needs a power-of-two block size >= 16, got {block}")
    return h, kh, n, d, max(16, triton.next_power_of_2(d))


def forward(
    q_HND: torch.Tensor,
    k_KND: torch.Tensor,
    v_KND: torch.Tensor,
    token_end_N: torch.Tensor,
    sparsity: BlockSparsity,
    block: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    h, kh, n, d, block_d = _shapes(q_HND, k_KND, block)
    o_HND = torch.empty_like(q_HND)
    lse_HN = torch.empty(h, n, dtype=torch.float32, device=q_HND.device)
    _fwd_kernel[(n // block, h)](
        q_HND, k_KND, v_KND, o_HND, lse_HN, token_end_N, sparsity.kv_ptr_n1, sparsity.kv_idx_P, scale, n, d,
        GROUP=h // kh, BLOCK=block, BLOCK_D=block_d, IEEE=q_HND.dtype == torch.float32,
    )  # fmt: skip
    return o_HND, lse_HN


def backward(
    q_HND: torch.Tensor,
    k_KND: torch.Tensor,
    v_KND: torch.Tensor,
    o_HND: torch.Tensor,
    lse_HN: torch.Tensor,
    do_HND: torch.Tensor,
    token_end_N: torch.Tensor,
    sparsity: BlockSparsity,
    block: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, kh, n, d, block_d = _shapes(q_HND, k_KND, block)
    delta_HN = (do_HND.float() * o_HND.float()).sum(-1)  # rowsum(dO * O), the softmax-backward term
    dq_HND = torch.empty_like(q_HND)
    dk_KND = torch.empty_like(k_KND)
    dv_KND = torch.empty_like(v_KND)
    ieee = q_HND.dtype == torch.float32
    _bwd_dkdv_kernel[(n // block, kh)](
        q_HND, k_KND, v_KND, do_HND, lse_HN, delta_HN, dk_KND, dv_KND, token_end_N, sparsity.last_q_n, scale, n, d,
        GROUP=h // kh, BLOCK=block, BLOCK_D=block_d, IEEE=ieee,
    )  # fmt: skip
    _bwd_dq_kernel[(n // block, h)](
        q_HND, k_KND, v_KND, do_HND, lse_HN, delta_HN, dq_HND, token_end_N, sparsity.kv_ptr_n1, sparsity.kv_idx_P,
        scale, n, d, GROUP=h // kh, BLOCK=block, BLOCK_D=block_d, IEEE=ieee,
    )  # fmt: skip
    return dq_HND, dk_KND, dv_KND
