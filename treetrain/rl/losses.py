"""RL losses: GRPO advantages, the PPO-clip policy loss and the critic's value loss.

Letters: M gathered positions of one micro-batch (layout order), all ``[M]`` tensors.

A loss returns the *sum* over masked tokens (and sums of its statistics); the engine
divides by the global token count it fixed before the micro-batch loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from treetrain.config import LossSettings, ValueLossSettings
from treetrain.engines.base import MAX_SUFFIX, MicroBatchOutput


class LossConfigError(ValueError):
    """A loss called without the inputs its settings need."""


def group_advantages(
    rewards: Sequence[float], groups: Sequence[int], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO: each reward minus its group's mean, over the group's standard deviation.

    ``groups[i]`` names the group (same prompt or task) of ``rewards[i]``. The standard
    deviation is the population one (``1/n``); a group whose rewards are all equal gets zero
    advantages (no signal, no division by zero).
    """
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids")
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        vals = [float(rewards[i]) for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        for i, v in zip(idx, vals, strict=True):
            out[i] = (v - mean) / (std + eps) if normalize_std else v - mean
    return out


class PPOLoss:
    """PPO-clip on per-token log-probs, with the options GRPO-style trainers use.

    Inputs (``[M]``, layout order): ``advantages`` (required); ``old_logprobs`` (the
    proximal policy; absent means the batch is trained once, right after it was generated,
    so the current log-probs detached are the old ones); ``behav_logprobs`` (the rollout
    engine's own log-probs: *decoupled* PPO weights each token by
    ``exp(old - behav)``, and drops tokens whose weight exceeds ``behav_imp_weight_cap``);
    ``ref_logprobs`` (needed when ``kl_coef > 0``: the k3 estimator of KL(policy || ref)).
    """

    def __init__(self, config: LossSettings) -> None:
        self.config = config
        self.needs_entropy = config.entropy_coef > 0

    def __call__(
        self, out: MicroBatchOutput, loss_mask: torch.Tensor, inputs: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        logp_M = out.logprobs
        assert logp_M is not None, "PPOLoss needs an actor's log-probs"
        mask_M = loss_mask.to(logp_M.dtype)
        adv_M = inputs["advantages"].to(logp_M.dtype)
        old_M = inputs["old_logprobs"].to(logp_M.dtype) if "old_logprobs" in inputs else logp_M.detach()
        ratio_M = torch.exp(logp_M - old_M)
        low, high = 1.0 - cfg.clip_eps, 1.0 + (cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps)
        surr1_M = ratio_M * adv_M
        surr2_M = torch.clamp(ratio_M, low, high) * adv_M
        pg_M = -torch.minimum(surr1_M, surr2_M)
        clipped_M = (surr2_M < surr1_M).to(logp_M.dtype)
        if cfg.dual_clip is not None:
            bound_M = -cfg.dual_clip * adv_M
            pg_M = torch.where(adv_M < 0, torch.minimum(pg_M, bound_M), pg_M)
        stats: dict[str, torch.Tensor] = {}
        if "behav_logprobs" in inputs:
            behav_M = inputs["behav_logprobs"].to(logp_M.dtype)
            # The rollout engine's log-probs vs the trainer's recomputed ones for the same tokens:
            # the train/rollout mismatch (a mean, and the worst token).
            gap_M = (old_M - behav_M).abs().detach() * mask_M
            stats["behav_mismatch"] = gap_M.sum()
            stats["behav_mismatch" + MAX_SUFFIX] = gap_M.max() if gap_M.numel() else gap_M.new_zeros(())
            weight_M = torch.exp(old_M - behav_M)
            if cfg.behav_imp_weight_cap is not None:
                keep_M = (weight_M <= cfg.behav_imp_weight_cap).to(logp_M.dtype)
                stats["behav_dropped"] = ((1 - keep_M) * mask_M).sum()
                weight_M = weight_M * keep_M
            pg_M = pg_M * weight_M
            stats["behav_weight"] = (weight_M * mask_M).sum()
        token_M = pg_M
        if cfg.kl_coef > 0:
            if "ref_logprobs" not in inputs:
                raise LossConfigError("kl_coef > 0 needs ref_logprobs: configure a ref model")
            delta_M = inputs["ref_logprobs"].to(logp_M.dtype) - logp_M
            kl_M = torch.exp(delta_M) - delta_M - 1  # k3: unbiased, always >= 0
            token_M = token_M + cfg.kl_coef * kl_M
            stats["kl"] = (kl_M.detach() * mask_M).sum()
        if cfg.entropy_coef > 0:
            assert out.entropy is not None
            token_M = token_M - cfg.entropy_coef * out.entropy
            stats["entropy"] = (out.entropy.detach() * mask_M).sum()
        stats["clip_fraction"] = (clipped_M * mask_M).sum()
        stats["ratio"] = (ratio_M.detach() * mask_M).sum()
        return (token_M * mask_M).sum(), stats


class ValueLoss:
    """Critic: ``0.5 * (V - returns)^2``, clipped around ``old_values`` when given (PPO style)."""

    needs_entropy = False

    def __init__(self, config: ValueLossSettings) -> None:
        self.config = config

    def __call__(
        self, out: MicroBatchOutput, loss_mask: torch.Tensor, inputs: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v_M = out.values
        assert v_M is not None, "ValueLoss needs a critic's values"
        mask_M = loss_mask.to(v_M.dtype)
        ret_M = inputs["returns"].to(v_M.dtype)
        err_M = (v_M - ret_M).square()
        if self.config.clip_eps is not None and "old_values" in inputs:
            old_M = inputs["old_values"].to(v_M.dtype)
            v_clip_M = old_M + torch.clamp(v_M - old_M, -self.config.clip_eps, self.config.clip_eps)
            err_M = torch.maximum(err_M, (v_clip_M - ret_M).square())
        return 0.5 * (err_M * mask_M).sum(), {"value_error": ((v_M.detach() - ret_M).abs() * mask_M).sum()}
