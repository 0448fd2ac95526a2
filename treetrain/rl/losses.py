"""RL losses: the decoupled PPO-clip policy loss every algorithm uses, and the critic's value
loss (advantages live in :mod:`treetrain.rl.advantages`).

Letters: M gathered positions of one micro-batch (layout order), all ``[M]`` tensors.

A loss returns the *sum* over masked tokens (and sums of its statistics); the engine
divides by the global token count it fixed before the micro-batch loop. Per-sample
aggregations come in as per-token ``loss_weights`` (make_batch computes them against that
count), so no engine needs to know about them.
"""

from __future__ import annotations

import torch

from treetrain.config import LossSettings, ValueLossSettings
from treetrain.config.algorithms import Objective
from treetrain.engines.batch import LossInputError, TokenFields
from treetrain.engines.contract import MicroBatchOutput
from treetrain.engines.stats import MAX_SUFFIX
from treetrain.rl.advantages import group_advantages

__all__ = ["LossConfigError", "LossInputError", "PPOLoss", "ValueLoss", "group_advantages", "segment_mean"]


class LossConfigError(ValueError):
    """A loss whose settings ask for an input it is told the batch will not carry."""


def segment_mean(x_M: torch.Tensor, index_M: torch.Tensor, mask_M: torch.Tensor) -> torch.Tensor:
    """Each position's sample mean of ``x_M`` over the sample's masked positions, ``[M]``.

    ``index_M`` names each position's sample (``sample_index``). A sample's positions are
    contiguous in layout order (the engines gather every sequence whole, in one micro-batch),
    so a new segment starts wherever the index changes: no host sync to count samples."""
    if x_M.numel() == 0:
        return x_M
    idx_M = index_M.long()
    starts_M = torch.ones_like(idx_M, dtype=torch.bool)
    starts_M[1:] = idx_M[1:] != idx_M[:-1]
    seg_M = torch.cumsum(starts_M.long(), 0) - 1
    sums = x_M.new_zeros(x_M.shape[0]).index_add(0, seg_M, x_M * mask_M)
    counts = mask_M.new_zeros(x_M.shape[0]).index_add(0, seg_M, mask_M)
    return (sums / counts.clamp_min(1))[seg_M]


class PPOLoss:
    """Decoupled PPO-clip on per-token log-probs, with the options of the algorithm presets.

    What the loss reads is fixed when it is built, never by what a batch happens to carry (the
    algorithm that builds the batch builds the loss too); a field it reads and the batch lacks is a
    LossInputError. Inputs (``[M]``, layout order): ``advantages``, always. ``proximal``: the
    ratio's denominator is ``old_logprobs`` (the weights at the start of the step, recomputed when
    a batch is trained several times); otherwise the current log-probs detached, which *are* those
    weights when the batch is trained once (exact, not an approximation). ``behaviour``: each token
    is weighted by ``exp(prox - behav_logprobs)`` (the rollout sampler's own log-probs), capped as
    ``behav_weight_mode`` says, and the train/rollout mismatch is measured. ``reference``: the k3
    estimate of KL(policy || ref) from ``ref_logprobs``, a statistic always and a penalty when
    ``kl_coef > 0`` (which needs it). ``loss_weights`` for an aggregation other than token-mean,
    ``sample_index`` for a sequence ratio or a sequence weight mode.
    """

    def __init__(
        self,
        config: LossSettings,
        objective: Objective | None = None,
        *,
        proximal: bool = True,
        behaviour: bool = False,
        reference: bool = False,
    ) -> None:
        self.config = config
        # Always: the entropy is a statistic the trainer reports every step, even without an
        # entropy bonus. It comes out of the log-normaliser's pass over the logits, and unused by
        # the loss it adds nothing to backward (bench/entropy_cost.py measures the price).
        self.needs_entropy = True
        self.proximal, self.behaviour, self.reference = proximal, behaviour, reference
        if config.kl_coef > 0 and not reference:
            raise LossConfigError("kl_coef > 0 needs ref_logprobs: configure a ref model")
        self.ratio_level = objective.ratio_level if objective else (config.ratio_level or "token")
        high = objective.clip_eps_high if objective else config.clip_eps_high
        self.clip_low, self.clip_high = 1.0 - config.clip_eps, 1.0 + (high if high is not None else config.clip_eps)
        self.per_sample = self.ratio_level == "sequence" or config.behav_weight_mode.startswith("sequence")
        aggregation = objective.aggregation if objective else (config.aggregation or "token-mean")
        self.weighted = aggregation != "token-mean"

    def __call__(
        self, out: MicroBatchOutput, loss_mask: torch.Tensor, inputs: TokenFields[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        logp_M = out.logprobs
        assert logp_M is not None, "PPOLoss needs an actor's log-probs"
        mask_M = loss_mask.to(logp_M.dtype)
        adv_M = inputs.need("advantages").to(logp_M.dtype)
        prox_M = inputs.need("old_logprobs").to(logp_M.dtype) if self.proximal else logp_M.detach()
        index_M = inputs.need("sample_index") if self.per_sample else None
        if index_M is not None and self.ratio_level == "sequence":
            # GSPO: one ratio per sample, exp of its mean log-ratio; the gradient reaches every token.
            ratio_M = torch.exp(segment_mean(logp_M - prox_M, index_M, mask_M))
        else:
            ratio_M = torch.exp(logp_M - prox_M)
        surr1_M = ratio_M * adv_M
        surr2_M = torch.clamp(ratio_M, self.clip_low, self.clip_high) * adv_M
        pg_M = -torch.minimum(surr1_M, surr2_M)
        clipped_M = (surr2_M < surr1_M).to(logp_M.dtype)
        if cfg.dual_clip is not None:
            bound_M = -cfg.dual_clip * adv_M
            pg_M = torch.where(adv_M < 0, torch.minimum(pg_M, bound_M), pg_M)
        stats: dict[str, torch.Tensor] = {}
        if self.behaviour:
            behav_M = inputs.need("behav_logprobs").to(logp_M.dtype)
            # The rollout engine's log-probs vs the trainer's recomputed ones for the same tokens:
            # the train/rollout mismatch (a mean, and the worst token).
            gap_M = (prox_M - behav_M).abs().detach() * mask_M
            stats["behav_mismatch"] = gap_M.sum()
            stats["behav_mismatch" + MAX_SUFFIX] = gap_M.max() if gap_M.numel() else gap_M.new_zeros(())
            pg_M = pg_M * self._behav_weight(prox_M, behav_M, mask_M, index_M, stats)
        token_M = pg_M
        if self.reference:
            delta_M = inputs.need("ref_logprobs").to(logp_M.dtype) - logp_M
            kl_M = torch.exp(delta_M) - delta_M - 1  # k3: unbiased, always >= 0
            if cfg.kl_coef > 0:
                token_M = token_M + cfg.kl_coef * kl_M
            stats["kl"] = (kl_M.detach() * mask_M).sum()
        if cfg.entropy_coef > 0:
            assert out.entropy is not None
            token_M = token_M - cfg.entropy_coef * out.entropy
        if out.entropy is not None:
            stats["entropy"] = (out.entropy.detach() * mask_M).sum()
        stats["clip_fraction"] = (clipped_M * mask_M).sum()
        ratio_masked_M = ratio_M.detach() * mask_M
        stats["ratio"] = ratio_masked_M.sum()
        # Ratios are positive, so masked-out positions (0) never win the maximum.
        stats["ratio" + MAX_SUFFIX] = ratio_masked_M.max() if ratio_masked_M.numel() else ratio_M.new_zeros(())
        if self.weighted:
            token_M = token_M * inputs.need("loss_weights").to(logp_M.dtype)
        return (token_M * mask_M).sum(), stats

    def _behav_weight(
        self,
        prox_M: torch.Tensor,
        behav_M: torch.Tensor,
        mask_M: torch.Tensor,
        index_M: torch.Tensor | None,
        stats: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The behaviour weight ``exp(prox - behav)`` per position, capped by the mode: per token
        or per sample (the geometric mean of the sample's token weights), masked past the cap
        (dropped) or truncated to it."""
        cap, mode = self.config.behav_imp_weight_cap, self.config.behav_weight_mode
        if mode.startswith("sequence"):
            assert index_M is not None
            weight_M = torch.exp(segment_mean(prox_M - behav_M, index_M, mask_M))
        else:
            weight_M = torch.exp(prox_M - behav_M)
        if cap is not None:
            if mode.endswith("mask"):
                keep_M = weight_M <= cap  # False for a NaN weight: dropped too
                stats["behav_dropped"] = ((~keep_M).to(prox_M.dtype) * mask_M).sum()
                weight_M = torch.where(keep_M, weight_M, torch.zeros_like(weight_M))  # NaN x 0 would stay NaN
            else:
                stats["behav_truncated"] = ((weight_M > cap).to(prox_M.dtype) * mask_M).sum()
                weight_M = torch.clamp(weight_M, max=cap)
        stats["behav_weight"] = (weight_M * mask_M).sum()
        return weight_M


class ValueLoss:
    """Critic: ``0.5 * (V - returns)^2``; with ``clipped`` and ``clip_eps`` set, clipped around
    ``old_values`` (PPO style), which the batch must then carry."""

    needs_entropy = False

    def __init__(self, config: ValueLossSettings, *, clipped: bool = False) -> None:
        self.config = config
        self.clipped = clipped and config.clip_eps is not None

    def __call__(
        self, out: MicroBatchOutput, loss_mask: torch.Tensor, inputs: TokenFields[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v_M = out.values
        assert v_M is not None, "ValueLoss needs a critic's values"
        mask_M = loss_mask.to(v_M.dtype)
        ret_M = inputs.need("returns").to(v_M.dtype)
        err_M = (v_M - ret_M).square()
        if self.clipped:
            eps = self.config.clip_eps
            assert eps is not None
            old_M = inputs.need("old_values").to(v_M.dtype)
            v_clip_M = old_M + torch.clamp(v_M - old_M, -eps, eps)
            err_M = torch.maximum(err_M, (v_clip_M - ret_M).square())
        return 0.5 * (err_M * mask_M).sum(), {"value_error": ((v_M.detach() - ret_M).abs() * mask_M).sum()}
