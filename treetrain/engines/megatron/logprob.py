"""Log-probs and entropy from vocab-parallel logits (each tensor-parallel rank holds
``V / t`` columns), exact in fp32, without gathering the vocabulary.

Letters: N tree rows, W = V / t local vocabulary columns, M gathered positions.

Forward: each rank computes its rows' local log-normaliser in row chunks; one all-gather of
those ``t x N`` numbers gives the global one; one all-reduce adds up the label logits (only
the rank that owns a label has it) and ``E_p[logit]`` for the entropy. Backward needs no
communication: ``d logp / d x_v = onehot(label)_v - p_v`` for this rank's columns, with the
global normaliser saved from the forward. Nothing of size ``M x V`` (or ``N x V``) exists.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

CHUNK = 1024


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x_NW: torch.Tensor,
        pred_M: torch.Tensor,
        label_M: torch.Tensor,
        vocab_start: int,
        group: Any,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, w = x_NW.shape
        parallel = group is not None and dist.get_world_size(group) > 1
        lse_N = torch.empty(n, dtype=torch.float32, device=x_NW.device)
        for r0 in range(0, n, CHUNK):
            lse_N[r0 : r0 + CHUNK] = torch.logsumexp(x_NW[r0 : r0 + CHUNK].float(), dim=-1)
        if parallel:
            parts = [torch.empty_like(lse_N) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, lse_N, group=group)
            lse_N = torch.logsumexp(torch.stack(parts), dim=0)
        mean_N = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=x_NW.device)
        if with_entropy:
            for r0 in range(0, n, CHUNK):
                x_CW = x_NW[r0 : r0 + CHUNK].float()
                mean_N[r0 : r0 + CHUNK] = (torch.exp(x_CW - lse_N[r0 : r0 + CHUNK, None]) * x_CW).sum(-1)
        local_M = label_M - vocab_start
        mine_M = (local_M >= 0) & (local_M < w)
        label_logit_M = torch.where(mine_M, x_NW[pred_M, local_M.clamp(0, w - 1)].float(), 0.0)
        if parallel:
            both = torch.cat((label_logit_M, mean_N))
            dist.all_reduce(both, group=group)
            label_logit_M, mean_N = both[: label_M.shape[0]], both[label_M.shape[0] :]
        logp_M = label_logit_M - lse_N[pred_M]
        entropy_M = (lse_N - mean_N)[pred_M] if with_entropy else logp_M.new_zeros(0)
        ctx.save_for_backward(x_NW, pred_M, local_M, mine_M, lse_N, mean_N)
        ctx.with_entropy = with_entropy
        # An output the loss does not use (the entropy, reported but unweighted) arrives in the
        # backward as None, not as zeros: no work is done for it.
        ctx.set_materialize_grads(False)
        return logp_M, entropy_M

    @staticmethod
    def backward(ctx: Any, grad_logp_M: torch.Tensor | None, grad_ent_M: torch.Tensor | None) -> tuple[Any, ...]:
        x_NW, pred_M, local_M, mine_M, lse_N, mean_N = ctx.saved_tensors
        n = x_NW.shape[0]
        use_ent = ctx.with_entropy and grad_ent_M is not None and grad_ent_M.numel() > 0
        if grad_logp_M is None:
            if not use_ent:
                return None, None, None, None, None, None
            grad_logp_M = torch.zeros(pred_M.shape[0], dtype=torch.float32, device=x_NW.device)
        rows_N = torch.zeros(n, dtype=torch.float32, device=x_NW.device).index_add_(0, pred_M, grad_logp_M.float())
        if use_ent:
            assert grad_ent_M is not None
            ent_N = torch.zeros(n, dtype=torch.float32, device=x_NW.device).index_add_(0, pred_M, grad_ent_M.float())
        grad_NW = torch.empty_like(x_NW)
        for r0 in range(0, n, CHUNK):
            x_CW = x_NW[r0 : r0 + CHUNK].float()
            p_CW = torch.exp(x_CW - lse_N[r0 : r0 + CHUNK, None])
            if use_ent:  # d entropy / d x_v = -p_v (x_v - E_p[x])
                g_CW = -p_CW * ((x_CW - mean_N[r0 : r0 + CHUNK, None]) * ent_N[r0 : r0 + CHUNK, None])
                g_CW -= p_CW * rows_N[r0 : r0 + CHUNK, None]
            else:
                g_CW = -p_CW * rows_N[r0 : r0 + CHUNK, None]
            grad_NW[r0 : r0 + CHUNK] = g_CW
        g_M = torch.where(mine_M, grad_logp_M.float(), 0.0).to(grad_NW.dtype)
        grad_NW.index_put_((pred_M, local_M.clamp(0, x_NW.shape[1] - 1)), g_M, accumulate=True)
        return grad_NW, None, None, None, None, None


def vocab_parallel_logprobs(
    logits_NW: torch.Tensor,
    pred_M: torch.Tensor,
    label_M: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: Any = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logp[m] = log_softmax(logits[pred[m]])[label[m]]`` over the whole vocabulary, fp32,
    where this rank holds columns ``[vocab_start, vocab_start + W)``; and the entropy."""
    logp, ent = _VocabParallelLogprobs.apply(logits_NW, pred_M, label_M, vocab_start, group, with_entropy)
    return logp, (ent if with_entropy else None)
