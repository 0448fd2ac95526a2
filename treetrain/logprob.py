"""Per-sequence log-probs and entropy from packed logits, and :func:`tree_logprobs`.

Letters: N tree tokens (rows of logits), V vocabulary, M gathered positions (over all
sequences of a tree, each sequence contributing ``len - 1``), S sequences.

:func:`gather_logprobs` owns the gather and the fp32 upcast. It computes one
log-normaliser per tree row (shared prefixes are normalised once, however many sequences
use them), in row chunks, so the fp32 working set is ``chunk_size x V``; its backward is
written out, so nothing of size ``M x V`` is ever saved. At a branch point the parent's
last row is gathered once per child, with each child's first token as the label.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treetrain.tree import DEFAULT_BLOCK_SIZE, PackConfig, PackedTree, pack

DEFAULT_CHUNK_SIZE = 1024


class _GatherLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits_NV: torch.Tensor,
        pred_M: torch.Tensor,
        label_M: torch.Tensor,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits_NV.shape[0]
        lse_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
        mean_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)  # E_p[logit], for entropy
        for r0 in range(0, n, chunk_size):
            x_CV = logits_NV[r0 : r0 + chunk_size].float()
            lse_C = torch.logsumexp(x_CV, dim=-1)
            lse_N[r0 : r0 + chunk_size] = lse_C
            if with_entropy:  # one exp and one dot per row on top of the normaliser's pass
                p_CV = torch.sub(x_CV, lse_C[:, None]).exp_()
                mean_N[r0 : r0 + chunk_size] = torch.linalg.vecdot(p_CV, x_CV)
        logp_M = logits_NV[pred_M, label_M].float() - lse_N[pred_M]
        entropy_M = (lse_N - mean_N)[pred_M] if with_entropy else logp_M.new_zeros(0)
        ctx.save_for_backward(logits_NV, pred_M, label_M, lse_N, mean_N)
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        # An output the loss does not differentiate (the entropy, read as a statistic) comes
        # back as None instead of zeros, so backward skips its work.
        ctx.set_materialize_grads(False)
        return logp_M, entropy_M

    @staticmethod
    def backward(
        ctx: Any, grad_logp_M: torch.Tensor | None, grad_entropy_M: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        logits_NV, pred_M, label_M, lse_N, mean_N = ctx.saved_tensors
        use_entropy = ctx.with_entropy and grad_entropy_M is not None and grad_entropy_M.numel() > 0
        if grad_logp_M is None:
            if not use_entropy:
                return None, None, None, None, None
            grad_logp_M = torch.zeros(pred_M.shape[0], dtype=torch.float32, device=logits_NV.device)
        n = logits_NV.shape[0]
        # d logp / d logit_v = onehot(label) - softmax; summed per row over the positions using it.
        rows_logp_N = torch.zeros(n, dtype=torch.float32, device=logits_NV.device)
        rows_logp_N.index_add_(0, pred_M, grad_logp_M.float())
        if use_entropy:
            assert grad_entropy_M is not None
            rows_ent_N = torch.zeros(n, dtype=torch.float32, device=logits_NV.device)
            rows_ent_N.index_add_(0, pred_M, grad_entropy_M.float())
        grad_NV = torch.empty_like(logits_NV)
        c = ctx.chunk_size
        in_place = grad_NV.dtype == torch.float32  # else work in an fp32 chunk, then cast
        for r0 in range(0, n, c):
            x_CV = logits_NV[r0 : r0 + c].float()
            out_CV = grad_NV[r0 : r0 + c] if in_place else None
            p_CV = torch.sub(x_CV, lse_N[r0 : r0 + c, None], out=out_CV).exp_()
            if use_entropy:
                # d entropy / d logit_v = -p_v (logit_v - E_p[logit])
                g_CV = (x_CV - mean_N[r0 : r0 + c, None]).mul_(rows_ent_N[r0 : r0 + c, None])
                g_CV.add_(rows_logp_N[r0 : r0 + c, None]).mul_(p_CV).neg_()
            else:
                g_CV = p_CV.mul_(rows_logp_N[r0 : r0 + c, None].neg())
            if g_CV is not out_CV:
                grad_NV[r0 : r0 + c] = g_CV
        grad_NV.index_put_((pred_M, label_M), grad_logp_M.to(grad_NV.dtype), accumulate=True)
        return grad_NV, None, None, None, None


def gather_logprobs(
    logits_NV: torch.Tensor,
    pred_M: torch.Tensor,
    label_M: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logp[m] = log_softmax(logits[pred[m]])[label[m]]`` in fp32, and the entropy of that row.

    One vectorized pass: row chunks of ``chunk_size`` for the normaliser, one gather.
    """
    if logits_NV.dim() != 2:
        raise ValueError(f"logits must be [tokens, vocab], got shape {tuple(logits_NV.shape)}")
    logp_M, entropy_M = _GatherLogprobs.apply(logits_NV, pred_M, label_M, chunk_size, with_entropy)
    return logp_M, (entropy_M if with_entropy else None)


@dataclass(frozen=True, slots=True)
class TreeTensors:
    """Model inputs and gather indices of one tree, on one device."""

    input_ids_N: torch.Tensor
    position_ids_N: torch.Tensor
    pred_M: torch.Tensor
    label_M: torch.Tensor
    split_sizes: tuple[int, ...]  # log-probs per sequence (len - 1), layout order

    @classmethod
    def from_tree(cls, tree: PackedTree, device: torch.device) -> TreeTensors:
        from treetrain.attention.meta import long_tensor

        cpu = torch.device("cpu")
        input_ids_N = long_tensor(tree.input_ids, cpu)
        position_ids_N = long_tensor(tree.position_ids, cpu)
        seq_tokens = long_tensor(tree.seq_tokens, cpu)
        offsets = long_tensor(tree.seq_offsets, cpu)
        first = torch.zeros(seq_tokens.shape[0], dtype=torch.bool)
        first[offsets[:-1]] = True
        last = torch.zeros_like(first)
        last[offsets[1:] - 1] = True
        pred_M = seq_tokens[~last]
        label_M = input_ids_N[seq_tokens[~first]]
        sizes = tuple(int(x) - 1 for x in torch.diff(offsets).tolist())
        return cls(
            input_ids_N=input_ids_N.to(device),
            position_ids_N=position_ids_N.to(device),
            pred_M=pred_M.to(device),
            label_M=label_M.to(device),
            split_sizes=sizes,
        )


def tree_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    max_tokens_per_mb: int,
    attention: str = "auto",
) -> list[torch.Tensor]:
    """Log-probs of each sequence under ``model``, computed on tries of shared prefixes.

    Returns, in input order, one fp32 tensor of length ``len(seq) - 1`` per sequence:
    entry ``i`` is ``log p(seq[i + 1] | seq[: i + 1])``. Gradients flow to the model.
    The model is switched to the ``"treetrain"`` attention implementation, which behaves
    like ``sdpa`` outside tree forwards. ``attention`` is an attention backend name
    (``auto``, ``sparse``, ``dense``, ``flex``, ``triton``).

    An entry point, so it reads the environment (here, at its top, and nowhere below):
    ``TREETRAIN_ATTENTION`` names the backend when ``attention`` is ``"auto"``, and
    ``TREETRAIN_BLOCK_SIZE`` sets the attention block size (default 128);
    ``max_tokens_per_mb`` must be a multiple of it.
    """
    attention, block_size = _environment(attention)
    logps, _ = _tree_logprobs(
        model, sequences, max_tokens_per_mb, attention, block_size, with_entropy=False, chunk_size=DEFAULT_CHUNK_SIZE
    )
    return logps


def tree_logprobs_entropy(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    max_tokens_per_mb: int,
    attention: str = "auto",
    with_entropy: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`tree_logprobs` plus, per sequence, the entropy of each predictive distribution
    (the same environment variables apply)."""
    attention, block_size = _environment(attention)
    return _tree_logprobs(model, sequences, max_tokens_per_mb, attention, block_size, with_entropy, chunk_size)


def _environment(attention: str) -> tuple[str, int]:
    """``TREETRAIN_ATTENTION`` (for ``auto``) and ``TREETRAIN_BLOCK_SIZE``, read by the entry points."""
    import os

    if attention == "auto":
        attention = os.environ.get("TREETRAIN_ATTENTION", "").strip() or "auto"
    raw = os.environ.get("TREETRAIN_BLOCK_SIZE", "").strip()
    if not raw:
        return attention, DEFAULT_BLOCK_SIZE
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TREETRAIN_BLOCK_SIZE must be a positive integer, got {raw!r}")
    return attention, int(raw)


def _tree_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    max_tokens_per_mb: int,
    attention: str,
    block_size: int,
    with_entropy: bool,
    chunk_size: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from treetrain.attention import TreeAttentionMeta, resolve, tree_forward, use_tree_attention

    if not sequences:
        return [], []
    device = _model_device(model)
    needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    backend = resolve(attention, device, needs_grad=needs_grad)
    batch = pack(sequences, PackConfig(max_tokens_per_mb=max_tokens_per_mb, block_size=block_size))
    use_tree_attention(model)
    per_tree_logp: list[list[torch.Tensor]] = []
    per_tree_ent: list[list[torch.Tensor]] = []
    for tree in batch.trees:
        tensors = TreeTensors.from_tree(tree, device)
        meta = TreeAttentionMeta.from_tree(tree, backend=backend, block_size=block_size, device=device)
        with tree_forward():
            out = model(
                input_ids=tensors.input_ids_N[None],
                position_ids=tensors.position_ids_N[None],
                use_cache=False,
                tree_attention=meta,
            )
        logits_NV = out.logits.view(out.logits.shape[-2], out.logits.shape[-1])  # a view: no select-backward copy
        logp_M, ent_M = gather_logprobs(
            logits_NV, tensors.pred_M, tensors.label_M, chunk_size=chunk_size, with_entropy=with_entropy
        )
        per_tree_logp.append(list(torch.split(logp_M, list(tensors.split_sizes))))
        if ent_M is not None:
            per_tree_ent.append(list(torch.split(ent_M, list(tensors.split_sizes))))
    return batch.unpack(per_tree_logp), (batch.unpack(per_tree_ent) if with_entropy else [])


def pack_sequence_tensors(tree: PackedTree, values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sequence tensors (input order, e.g. advantages or a loss mask, each ``len - 1``
    long to line up with log-probs) concatenated in the layout order of ``tree``: the same
    order as that tree's gathered log-probs."""
    return torch.cat([values[i] for i in tree.seq_ids]) if tree.seq_ids else values[0].new_zeros(0)


def unpack_sequence_tensors(tree: PackedTree, flat: torch.Tensor, lengths: Sequence[int]) -> dict[int, torch.Tensor]:
    """Inverse of :func:`pack_sequence_tensors`: input index -> that sequence's slice."""
    parts = torch.split(flat, [lengths[i] for i in tree.seq_ids])
    return dict(zip(tree.seq_ids, parts, strict=True))


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
