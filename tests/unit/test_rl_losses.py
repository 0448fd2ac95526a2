"""Losses: GRPO advantages, PPO clipping (both sides, dual clip), token masks, decoupled
behaviour weights, k3 KL, the value loss, and the global-count division over uneven
micro-batches (in the engine, against one big batch)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from treetrain.config import LossSettings, ValueLossSettings
from treetrain.engines.batch import TokenFields
from treetrain.engines.contract import MicroBatchOutput
from treetrain.rl.losses import LossConfigError, LossInputError, PPOLoss, ValueLoss, group_advantages


@pytest.mark.parametrize(
    ("rewards", "groups", "normalize", "want"),
    [
        ([1.0, 0.0, 1.0, 0.0], [0, 0, 0, 0], True, [1.0, -1.0, 1.0, -1.0]),
        ([1.0, 3.0, 5.0, 5.0], [0, 0, 1, 1], False, [-1.0, 1.0, 0.0, 0.0]),
        ([2.0, 2.0, 2.0], [7, 7, 7], True, [0.0, 0.0, 0.0]),  # no signal: zeros, no NaN
        ([0.0, 1.0, 0.0, 1.0], [0, 1, 0, 1], True, [0.0, 0.0, 0.0, 0.0]),  # groups are interleaved
        ([0.0, 3.0], [0, 0], True, [-1.0, 1.0]),
    ],
)
def test_group_advantages(rewards: list[float], groups: list[int], normalize: bool, want: list[float]) -> None:
    assert group_advantages(rewards, groups, normalize_std=normalize) == pytest.approx(want, abs=1e-5)


def test_group_advantages_use_the_population_std() -> None:
    adv = group_advantages([0.0, 1.0, 2.0], [0, 0, 0], eps=0.0)
    std = math.sqrt(2 / 3)
    assert adv == pytest.approx([-1 / std, 0.0, 1 / std])


def _out(logp: list[float]) -> MicroBatchOutput:
    return MicroBatchOutput(logprobs=torch.tensor(logp, requires_grad=True))


@pytest.mark.parametrize(
    ("ratio", "adv", "clipped", "want_loss", "want_grad"),
    [
        (1.1, 1.0, False, -1.1, -1.1),  # inside the range: -ratio * A
        (1.5, 1.0, True, -1.2, 0.0),  # above 1 + eps with A > 0: clipped, no gradient
        (0.5, 1.0, False, -0.5, -0.5),  # below 1 - eps with A > 0: the unclipped side is smaller
        (0.5, -1.0, True, 0.8, 0.0),  # below 1 - eps with A < 0: clipped
        (1.5, -1.0, False, 1.5, 1.5),  # above 1 + eps with A < 0: unclipped (pessimistic)
    ],
)
def test_ppo_clip(ratio: float, adv: float, clipped: bool, want_loss: float, want_grad: float) -> None:
    loss = PPOLoss(LossSettings(clip_eps=0.2, behav_imp_weight_cap=None))
    out = _out([math.log(ratio)])
    value, stats = loss(out, torch.ones(1), TokenFields(advantages=torch.tensor([adv]), old_logprobs=torch.zeros(1)))
    value.backward()
    assert float(value.detach()) == pytest.approx(want_loss)
    assert out.logprobs is not None and out.logprobs.grad is not None
    assert float(out.logprobs.grad[0]) == pytest.approx(want_grad)  # d(-ratio*A)/dlogp = -ratio*A
    assert float(stats["clip_fraction"]) == float(clipped)


def test_clip_higher_and_dual_clip() -> None:
    high = PPOLoss(LossSettings(clip_eps=0.2, clip_eps_high=0.28, behav_imp_weight_cap=None))
    value, _ = high(
        _out([math.log(1.5)]), torch.ones(1), TokenFields(advantages=torch.ones(1), old_logprobs=torch.zeros(1))
    )
    assert float(value.detach()) == pytest.approx(-1.28)
    dual = PPOLoss(LossSettings(clip_eps=0.2, dual_clip=3.0, behav_imp_weight_cap=None))
    inputs = TokenFields(advantages=torch.tensor([-1.0]), old_logprobs=torch.zeros(1))
    value, _ = dual(_out([math.log(10.0)]), torch.ones(1), inputs)
    assert float(value.detach()) == pytest.approx(3.0)  # bounded at dual_clip * |A| instead of 10


def test_masked_tokens_contribute_nothing() -> None:
    loss = PPOLoss(LossSettings(), proximal=False)
    out = _out([-1.0, -2.0, -3.0])
    value, stats = loss(out, torch.tensor([0.0, 1.0, 0.0]), TokenFields(advantages=torch.tensor([5.0, 2.0, 7.0])))
    value.backward()
    assert float(value.detach()) == pytest.approx(-2.0)  # old = current (detached): ratio 1
    assert out.logprobs is not None and out.logprobs.grad is not None
    assert out.logprobs.grad.tolist() == pytest.approx([0.0, -2.0, 0.0])
    assert float(stats["ratio"]) == pytest.approx(1.0)


def test_decoupled_behaviour_weights_and_cap() -> None:
    loss = PPOLoss(LossSettings(behav_imp_weight_cap=2.0), behaviour=True)
    inputs = TokenFields(
        advantages=torch.ones(2),
        old_logprobs=torch.tensor([-1.0, -1.0]),
        behav_logprobs=torch.tensor([-1.0 - math.log(1.5), -1.0 - math.log(3.0)]),  # weights 1.5 and 3
    )
    value, stats = loss(_out([-1.0, -1.0]), torch.ones(2), inputs)
    assert float(value.detach()) == pytest.approx(-1.5)  # the token over the cap is dropped
    assert float(stats["behav_dropped"]) == 1.0
    # The train/rollout mismatch: |trainer - sampler| per token, summed (the engine divides) and at worst.
    assert float(stats["behav_mismatch"]) == pytest.approx(math.log(1.5) + math.log(3.0))
    assert float(stats["behav_mismatch_max"]) == pytest.approx(math.log(3.0))


def test_a_nan_behaviour_weight_is_dropped_not_spread() -> None:
    # A sampler log-prob of NaN (a broken server reply): that token goes, the rest trains as before.
    loss = PPOLoss(LossSettings(behav_imp_weight_cap=2.0), behaviour=True)
    inputs = TokenFields(
        advantages=torch.ones(2),
        old_logprobs=torch.tensor([-1.0, -1.0]),
        behav_logprobs=torch.tensor([-1.0 - math.log(1.5), float("nan")]),
    )
    out = _out([-1.0, -1.0])
    value, stats = loss(out, torch.ones(2), inputs)
    assert float(value.detach()) == pytest.approx(-1.5) and float(stats["behav_dropped"]) == 1.0
    value.backward()
    assert out.logprobs.grad is not None and out.logprobs.grad.tolist() == pytest.approx([-1.5, 0.0])


def test_max_stats_reduce_as_maxima_and_sums_as_means() -> None:
    from treetrain.engines.stats import StatTotals

    totals = StatTotals(torch.device("cpu"))
    totals.add({"gap": torch.tensor(3.0), "gap_max": torch.tensor(0.5)})
    totals.add({"gap": torch.tensor(1.0), "gap_max": torch.tensor(2.0)})
    assert totals.reduce(total=4) == {"gap": 1.0, "gap_max": 2.0}


def test_kl_needs_ref_and_is_k3() -> None:
    with pytest.raises(LossConfigError, match="ref_logprobs"):
        PPOLoss(LossSettings(kl_coef=0.5), proximal=False)
    loss = PPOLoss(LossSettings(kl_coef=0.5), proximal=False, reference=True)
    with pytest.raises(LossInputError, match="ref_logprobs"):
        loss(_out([-1.0]), torch.ones(1), TokenFields(advantages=torch.zeros(1)))
    value, stats = loss(
        _out([-1.0]), torch.ones(1), TokenFields(advantages=torch.zeros(1), ref_logprobs=torch.tensor([-2.0]))
    )
    k3 = math.exp(-1.0) + 1.0 - 1.0
    assert float(stats["kl"]) == pytest.approx(k3)
    assert float(value.detach()) == pytest.approx(0.5 * k3)


def test_entropy_bonus_asks_for_entropy() -> None:
    loss = PPOLoss(LossSettings(entropy_coef=0.1), proximal=False)
    assert loss.needs_entropy
    out = MicroBatchOutput(logprobs=torch.tensor([-1.0]), entropy=torch.tensor([2.0]))
    value, stats = loss(out, torch.ones(1), TokenFields(advantages=torch.zeros(1)))
    assert float(value.detach()) == pytest.approx(-0.2)
    assert float(stats["entropy"]) == pytest.approx(2.0)


def test_entropy_and_kl_are_reported_without_entering_the_loss() -> None:
    """The trainer reports entropy every step and KL whenever a reference exists: with both
    coefficients 0 they are statistics only, and the loss is the plain clipped surrogate."""
    loss = PPOLoss(LossSettings(), proximal=False, reference=True)
    assert loss.needs_entropy  # always asked for: the step line and treetrain_policy_entropy show it
    out = MicroBatchOutput(logprobs=torch.tensor([-1.0, -1.0]), entropy=torch.tensor([2.0, 4.0]))
    mask = torch.tensor([1.0, 0.0])
    value, stats = loss(out, mask, TokenFields(advantages=torch.ones(2), ref_logprobs=torch.tensor([-2.0, -2.0])))
    assert float(value.detach()) == pytest.approx(-1.0)  # -ratio * advantage of the one masked-in token
    assert float(stats["entropy"]) == pytest.approx(2.0)  # masked token only
    assert float(stats["kl"]) == pytest.approx(math.exp(-1.0) + 1.0 - 1.0)


def test_ratio_max_is_the_largest_masked_ratio() -> None:
    loss = PPOLoss(LossSettings())
    logp = torch.tensor([-1.0, -0.5, 0.0])
    old = torch.tensor([-1.0, -1.0, -2.0])  # ratios 1, e^0.5, e^2 (the last one masked out)
    _, stats = loss(
        _out(logp.tolist()), torch.tensor([1.0, 1.0, 0.0]), TokenFields(advantages=torch.ones(3), old_logprobs=old)
    )
    assert float(stats["ratio_max"]) == pytest.approx(math.exp(0.5))
    assert float(stats["ratio"]) == pytest.approx(1.0 + math.exp(0.5))  # a sum; the engine divides by tokens


def test_value_loss_clips_around_old_values() -> None:
    loss = ValueLoss(ValueLossSettings(clip_eps=0.1), clipped=True)
    out = MicroBatchOutput(values=torch.tensor([1.0, 0.5]))
    inputs = TokenFields(returns=torch.tensor([0.0, 0.5]), old_values=torch.tensor([0.0, 0.5]))
    value, _ = loss(out, torch.tensor([1.0, 1.0]), inputs)
    # token 0: unclipped error 1.0, clipped prediction 0.1 -> error 0.01; the max is kept
    assert float(value.detach()) == pytest.approx(0.5 * 1.0)


@pytest.mark.parametrize(
    "bad",
    [{"clip_eps": 0.0}, {"clip_eps": 1.5}, {"dual_clip": 1.0}, {"kl_coef": -1.0}, {"behav_imp_weight_cap": 0.5}],
)
def test_bad_config_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        LossSettings(**bad)


def test_uneven_micro_batches_give_the_global_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine divides every micro-batch by one count fixed before the loop: many small
    uneven trees, one big tree and flat packing all give the same loss and gradients."""
    from helpers import TINY_LLAMA as MODEL
    from helpers import make_batch

    from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    batch = make_batch(seed=1)
    loss = PPOLoss(LossSettings())
    results = []
    for cap, tree in ((64, True), (512, True), (64, False)):
        settings = TreeTrainingSettings(max_tokens_per_mb=cap, block_size=16)
        engine = build_engine(ModelSettings(**MODEL), "fsdp:d1", tree=settings, optimizer=OptimizerSettings())
        stats = engine.forward_backward(batch, loss, tree=tree)
        results.append((stats, engine.full_grads()))
    counts = [s.micro_batches for s, _ in results]
    assert counts[0] > counts[1] == 1 and counts[2] > counts[0], counts
    base_stats, base_grads = results[1]
    for stats, grads in (results[0], results[2]):
        assert stats.loss == pytest.approx(base_stats.loss, rel=1e-5, abs=1e-7)
        for name, g in base_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6)
