"""The algorithm presets against hand-computed cases (RLOO, REINFORCE++-baseline, Dr.GRPO,
DAPO, GSPO, the behaviour weight modes), dynamic sampling played inline by the group scheduler, the
config checks of the new options, and the per-sample reductions tree-packed vs flat on the
fsdp, megatron and archon engines."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TrainerSettings, TreeTrainingSettings
from treetrain.config.algorithms import PRESETS, objective
from treetrain.engines.batch import LossInputError, TokenFields, TrainBatch
from treetrain.engines.contract import MicroBatchOutput
from treetrain.rl.advantages import (
    advantages,
    informative_groups,
    overlong_penalty,
    reinforce_baseline_advantages,
    rloo_advantages,
)
from treetrain.rl.algorithm import Algorithm, loss_weights
from treetrain.rl.algorithm import make_batch as batch_of
from treetrain.rl.episodes import TaskSource
from treetrain.rl.losses import PPOLoss, group_advantages, segment_mean
from treetrain.rl.samples import Rollouts, Sample, seed_of
from treetrain.rl.scheduler import GroupScheduler


def _out(logp: list[float]) -> MicroBatchOutput:
    return MicroBatchOutput(logprobs=torch.tensor(logp, requires_grad=True))


def _rollouts(replies: list[int], rewards: list[float], groups: list[int], max_new_tokens: int = 8) -> Rollouts:
    """One sample per episode: a 2-token prompt and a reply of ``replies[i]`` tokens whose
    behaviour log-probs are 0."""
    samples = [
        Sample(episode=i, tokens=[1, 2] + [10] * n, prompt_len=2, logprobs=[0.0] * (2 + n))
        for i, n in enumerate(replies)
    ]
    return Rollouts(samples=samples, rewards=rewards, groups=groups, max_new_tokens=max_new_tokens)


def make_batch(rollouts: Rollouts, settings: TrainerSettings) -> TrainBatch:
    """The batch the algorithm of ``settings`` builds."""
    return batch_of(rollouts, objective(settings))


def _micro_batch(batch: TrainBatch) -> tuple[torch.Tensor, TokenFields[torch.Tensor]]:
    """The whole batch as one micro-batch in input order (what a flat single tree gathers)."""
    return torch.cat(batch.loss_mask), batch.fields.map(torch.cat)


# -- advantages ---------------------------------------------------------------------------


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    # group 0 = [3, 1, 2]: 3 - (1+2)/2 = 1.5; 1 - (3+2)/2 = -1.5; 2 - (3+1)/2 = 0.
    # group 5 = [7]: no others, advantage 0.
    got = rloo_advantages([3.0, 1.0, 2.0, 7.0], [0, 0, 0, 5])
    assert got == pytest.approx([1.5, -1.5, 0.0, 0.0])
    assert advantages("rloo", [3.0, 1.0, 2.0, 7.0], [0, 0, 0, 5], normalize_std=False) == got


def test_reinforce_plus_plus_baseline_normalises_over_the_batch() -> None:
    # group 0 = [1, 0] (mean 0.5): centred 0.5, -0.5; group 1 = [3, 3]: 0, 0.
    # Over the batch [0.5, -0.5, 0, 0]: mean 0, population variance (0.25+0.25)/4 = 0.125,
    # std = 0.353553..., so 0.5 / 0.353553 = 1.414213 (GRPO would give 1 and -1 per group).
    got = reinforce_baseline_advantages([1.0, 0.0, 3.0, 3.0], [0, 0, 1, 1], eps=0.0)
    assert got == pytest.approx([math.sqrt(2), -math.sqrt(2), 0.0, 0.0])
    assert group_advantages([1.0, 0.0, 3.0, 3.0], [0, 0, 1, 1]) == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)


def test_dr_grpo_advantages_have_no_std() -> None:
    # group [1, 0, 0, 0]: mean 0.25, so 0.75, -0.25, -0.25, -0.25 (GRPO would divide by 0.433).
    obj = objective(TrainerSettings(algorithm="dr-grpo"))
    got = advantages(obj.advantage, [1.0, 0.0, 0.0, 0.0], [0] * 4, normalize_std=obj.normalize_advantages)
    assert got == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_informative_groups_and_the_overlong_penalty() -> None:
    # group 0: [1, 1] equal -> dropped; group 1: [0, 1] -> kept; group 2: [0.5] alone -> dropped.
    assert informative_groups([1.0, 1.0, 0.0, 1.0, 0.5], [0, 0, 1, 1, 2]) == {1}
    # max 16, buffer 4: free up to 12, then -1/4 per token down to -1 at 16, and -1 past it.
    want = {12: 0.0, 13: -0.25, 14: -0.5, 16: -1.0, 20: -1.0}
    assert {n: overlong_penalty(n, 16, 4, 1.0) for n in want} == pytest.approx(want)
    assert overlong_penalty(14, 16, 4, 0.5) == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="at least 1 token"):
        overlong_penalty(3, 4, 0, 1.0)


def test_dapo_shapes_rewards_with_the_overlong_penalty() -> None:
    # maxNewTokens 10, buffer 10 // 5 = 2: replies of 9, 10, 4 tokens lose 0.5, 1 and 0.
    # Rewards [1, 1, 0] become [0.5, 0, 0] in one group: mean 1/6, deviations 1/3, -1/6, -1/6,
    # population std sqrt((1/9 + 1/36 + 1/36) / 3) = sqrt(1/18) = 0.2357.
    batch = make_batch(
        _rollouts([9, 10, 4], [1.0, 1.0, 0.0], [0, 0, 0], max_new_tokens=10), TrainerSettings(algorithm="dapo")
    )
    adv = [float(a[-1]) for a in batch.fields.need("advantages")]
    std = math.sqrt(1 / 18)
    assert adv == pytest.approx([(1 / 3) / std, (-1 / 6) / std, (-1 / 6) / std], rel=1e-5)
    # An explicit overlong section wins: penalty 0 turns it off (equal rewards -> 1, 1, -2 over std).
    off = TrainerSettings(algorithm="dapo", overlong={"penalty": 0.0})
    assert objective(off).overlong is None


# -- aggregation --------------------------------------------------------------------------


def test_token_mean_is_the_default_and_adds_no_tensors() -> None:
    """grpo (every default) leaves the batch as before: advantages and behaviour log-probs only,
    GRPO's group advantages."""
    rollouts = _rollouts([2, 4], [1.0, 0.0], [0, 0])
    batch = make_batch(rollouts, TrainerSettings())
    assert sorted(name for name, _ in batch.fields.present()) == ["advantages", "behav_logprobs"]
    want = group_advantages([1.0, 0.0], [0, 0])
    assert [float(a[-1]) for a in batch.fields.need("advantages")] == torch.tensor(want).tolist()  # fp32, as before
    assert loss_weights(rollouts, objective(TrainerSettings(algorithm="dapo"))) is None  # DAPO: token-mean too


def test_dr_grpo_constant_length_aggregation() -> None:
    # Replies of 2 and 4 tokens (T = 6 trained tokens, S = 2 samples), L = maxNewTokens = 8.
    # Advantages (no std): rewards [1, 0] -> [0.5, -0.5]. Each token weighs T / (S L) = 6/16.
    # With ratio 1 every token's term is -A: sum = 2 * (-0.5) + 4 * 0.5 = 1.0, and the engine's
    # division by T gives 6/16 * 1.0 / 6 = 1 / 16 = sum / (S L).
    rollouts = _rollouts([2, 4], [1.0, 0.0], [0, 0])
    batch = make_batch(rollouts, TrainerSettings(algorithm="dr-grpo"))
    mask, inputs = _micro_batch(batch)
    assert inputs.need("loss_weights")[mask > 0].tolist() == pytest.approx([6 / 16] * 6)
    dr_grpo = objective(TrainerSettings(algorithm="dr-grpo"))
    value, _ = PPOLoss(LossSettings(), dr_grpo, proximal=False, behaviour=True)(_out([0.0] * len(mask)), mask, inputs)
    assert float(value.detach()) / batch.num_loss_tokens() == pytest.approx(1 / 16)
    # aggregationLength replaces maxNewTokens: L = 3 -> each token 6 / (2 * 3) = 1.
    explicit = TrainerSettings(algorithm="dr-grpo", loss={"aggregationLength": 3})
    assert loss_weights(rollouts, objective(explicit)) == pytest.approx([1.0, 1.0])


def test_sequence_mean_weighs_every_sample_once() -> None:
    # T = 6, S = 2: sample 0 (2 tokens) weighs 6 / (2 * 2) = 1.5, sample 1 (4 tokens) 6 / (2 * 4) = 0.75;
    # so after the engine's / T each sample's tokens add up to 1/2: sum(w n) / T = (3 + 3) / 6.
    got = loss_weights(_rollouts([2, 4], [1.0, 0.0], [0, 0]), objective(TrainerSettings(algorithm="gspo")))
    assert got == pytest.approx([1.5, 0.75])


# -- ratios and behaviour weights ---------------------------------------------------------


def test_gspo_sequence_ratio_and_clip() -> None:
    # Sample 0 (positions 0-2, position 0 a prompt): log-ratios 0.1, 0.3 -> mean 0.2,
    # s0 = e^0.2 = 1.2214 > 1.2 with A = 1 > 0: clipped, term -1.2 per token, no gradient.
    # Sample 1 (positions 3-4): log-ratios 0.05, -0.05 -> s1 = 1, A = -2: term 2 per token.
    # ds1/dlogp_t = s1 / n, and each of the n tokens carries -s1 A, so the gradient of the sum
    # for each of its tokens is n * (-A s1 / n) = -A s1 = 2 (token-mean; the same as per token).
    loss = PPOLoss(LossSettings(clip_eps=0.2, behav_imp_weight_cap=None), objective(TrainerSettings(algorithm="gspo")))
    out = _out([-1.0, -1.0, -2.0, -1.0, -1.0])
    inputs = TokenFields(
        advantages=torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0]),
        old_logprobs=torch.tensor([-5.0, -1.1, -2.3, -1.05, -0.95]),
        sample_index=torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0]),
        loss_weights=torch.ones(5),  # gspo's sequence-mean weights, all 1 here: the hand-computed sums hold
    )
    value, stats = loss(out, torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0]), inputs)
    value.backward()
    assert float(value.detach()) == pytest.approx(2 * -1.2 + 2 * 2.0)
    assert out.logprobs is not None and out.logprobs.grad is not None
    assert out.logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 2.0, 2.0])
    assert float(stats["clip_fraction"]) == 2.0
    assert float(stats["ratio"]) == pytest.approx(2 * math.exp(0.2) + 2 * 1.0)


def test_gspo_without_old_logprobs_is_ratio_one() -> None:
    # One update per batch: prox = the current log-probs detached (exact), so s = 1 and the
    # gradient per token is -A s = -3 (see above); the value is 2 tokens x -3.
    gspo = objective(TrainerSettings(algorithm="gspo"))
    loss = PPOLoss(LossSettings(behav_imp_weight_cap=None), gspo, proximal=False)
    out = _out([-1.0, -4.0])
    inputs = TokenFields(advantages=torch.full((2,), 3.0), sample_index=torch.zeros(2), loss_weights=torch.ones(2))
    value, _ = loss(out, torch.ones(2), inputs)
    value.backward()
    assert float(value.detach()) == pytest.approx(-6.0)
    assert out.logprobs is not None and out.logprobs.grad is not None
    assert out.logprobs.grad.tolist() == pytest.approx([-3.0, -3.0])


@pytest.mark.parametrize(
    ("mode", "want_loss", "stat", "count"),
    [
        # token weights: sample 0 [1.5, 3.0], sample 1 [1.2, 1.2]; cap 2; every term -1 (ratio 1, A 1).
        ("token-mask", -(1.5 + 1.2 + 1.2), "behav_dropped", 1.0),  # the 3.0 token dropped
        ("token-truncate", -(1.5 + 2.0 + 1.2 + 1.2), "behav_truncated", 1.0),  # 3.0 -> 2
        # sequence weights: sqrt(1.5 * 3) = 2.1213 > 2 for sample 0, sqrt(1.2 * 1.2) = 1.2 for sample 1
        ("sequence-mask", -(1.2 + 1.2), "behav_dropped", 2.0),  # sample 0 dropped whole
        ("sequence-truncate", -(2.0 + 2.0 + 1.2 + 1.2), "behav_truncated", 2.0),
    ],
)
def test_behaviour_weight_modes(mode: str, want_loss: float, stat: str, count: float) -> None:
    loss = PPOLoss(LossSettings(behav_imp_weight_cap=2.0, behav_weight_mode=mode), behaviour=True)  # type: ignore[arg-type]
    prox = torch.tensor([-1.0, -1.0, -2.0, -2.0])
    inputs = TokenFields(
        advantages=torch.ones(4),
        old_logprobs=prox,
        behav_logprobs=prox - torch.log(torch.tensor([1.5, 3.0, 1.2, 1.2])),
        sample_index=torch.tensor([0.0, 0.0, 1.0, 1.0]),
    )
    value, stats = loss(_out(prox.tolist()), torch.ones(4), inputs)
    assert float(value.detach()) == pytest.approx(want_loss, rel=1e-5)
    assert float(stats[stat]) == count


def test_a_loss_names_the_field_its_settings_read_and_the_batch_lacks() -> None:
    """What the loss reads is fixed when it is built: a batch without it is one clear error,
    never a silently different objective."""
    from treetrain.rl.losses import LossConfigError

    one = TokenFields(advantages=torch.ones(1), old_logprobs=torch.zeros(1))
    with pytest.raises(LossInputError, match="sample_index"):
        PPOLoss(LossSettings(behav_weight_mode="sequence-mask"))(_out([-1.0]), torch.ones(1), one)
    with pytest.raises(LossInputError, match="behav_logprobs"):
        PPOLoss(LossSettings(), behaviour=True)(_out([-1.0]), torch.ones(1), one)
    with pytest.raises(LossInputError, match="old_logprobs"):
        PPOLoss(LossSettings())(_out([-1.0]), torch.ones(1), TokenFields(advantages=torch.ones(1)))
    with pytest.raises(LossConfigError, match="ref_logprobs"):
        PPOLoss(LossSettings(kl_coef=0.1))


def test_segment_mean_over_masked_positions() -> None:
    # samples 4, 4, 9, 9, 9 with the first of each masked out: means (2) and (4 + 6) / 2 = 5.
    got = segment_mean(
        torch.tensor([100.0, 2.0, 100.0, 4.0, 6.0]),
        torch.tensor([4.0, 4.0, 9.0, 9.0, 9.0]),
        torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0]),
    )
    assert got.tolist() == [2.0, 2.0, 5.0, 5.0, 5.0]


def _todays_loss(
    logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, old: torch.Tensor, behav: torch.Tensor
) -> torch.Tensor:
    """The policy loss before the algorithm options (clip 0.2, dual clip 3, cap 5), term for term."""
    ratio = torch.exp(logp - old)
    surr1, surr2 = ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv
    pg = -torch.minimum(surr1, surr2)
    pg = torch.where(adv < 0, torch.minimum(pg, -3.0 * adv), pg)
    weight = torch.exp(old - behav)
    weight = weight * (weight <= 5.0).to(logp.dtype)
    return (pg * weight * mask).sum()


def test_the_grpo_default_gives_todays_numbers_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(7)
    logp = -3.0 + torch.randn(64, generator=g)
    old = logp + 0.3 * torch.randn(64, generator=g)
    behav = old + torch.randn(64, generator=g)  # some weights past the cap of 5
    adv, mask = torch.randn(64, generator=g), (torch.rand(64, generator=g) > 0.3).float()
    inputs = TokenFields(advantages=adv, old_logprobs=old, behav_logprobs=behav)
    loss = PPOLoss(LossSettings(dual_clip=3.0), objective(TrainerSettings()), behaviour=True)
    value, stats = loss(MicroBatchOutput(logprobs=logp), mask, inputs)
    assert torch.equal(value, _todays_loss(logp, mask, adv, old, behav))
    assert float(stats["behav_dropped"]) > 0


# -- presets and config -------------------------------------------------------------------


def test_presets_and_an_explicit_option_wins() -> None:
    assert set(PRESETS) == {"grpo", "ppo", "rloo", "reinforce++", "dr-grpo", "dapo", "gspo"}
    dapo = objective(TrainerSettings(algorithm="dapo"))
    assert (dapo.dynamic_sampling, dapo.clip_eps_high, dapo.aggregation) == (True, 0.28, "token-mean")
    gspo = objective(TrainerSettings(algorithm="gspo"))
    assert (gspo.ratio_level, gspo.aggregation, gspo.per_sample) == ("sequence", "sequence-mean", True)
    mine = objective(
        TrainerSettings(
            algorithm="dapo", dynamic_sampling=False, loss={"clipEpsHigh": 0.3, "aggregation": "sequence-mean"}
        )
    )
    assert (mine.dynamic_sampling, mine.clip_eps_high, mine.aggregation) == (False, 0.3, "sequence-mean")
    # clip-higher from the preset reaches the loss: ratio 1.5 with A = 1 is clipped at 1.28.
    value, _ = PPOLoss(LossSettings(behav_imp_weight_cap=None), dapo)(
        _out([math.log(1.5)]), torch.ones(1), TokenFields(advantages=torch.ones(1), old_logprobs=torch.zeros(1))
    )
    assert float(value.detach()) == pytest.approx(-1.28)
    grpo = objective(TrainerSettings())
    assert (grpo.advantage, grpo.normalize_advantages, grpo.per_sample, grpo.overlong) == ("group", True, False, None)


def _problems(trainer: dict[str, Any], **top: Any) -> list[str]:
    from treetrain.config import ConfigError, validate

    try:
        validate({"model": {"path": "builtin:tiny-llama"}, "trainer": {"task": "builtin:parity", **trainer}, **top})
    except ConfigError as err:
        return [str(err)]
    return []


def test_config_checks_of_the_algorithm_options() -> None:
    assert _problems({"algorithm": "gspo"}) == []
    assert "needs a critic" in " ".join(_problems({"advantage": "critic"}))
    assert "uses no critic" in " ".join(_problems({"algorithm": "rloo"}, critic={}))
    assert "groupSize" in " ".join(_problems({"algorithm": "rloo", "groupSize": 1}))
    assert "groupSize" in " ".join(_problems({"algorithm": "dapo", "groupSize": 1}))
    assert "aggregationLength" in " ".join(_problems({"loss": {"aggregationLength": 8}}))
    assert _problems({"algorithm": "dr-grpo", "loss": {"aggregationLength": 8}}) == []
    split = _problems({"algorithm": "gspo"}, actor={"backend": "megatron:c2"})
    assert "context parallelism" in " ".join(split), split
    assert "behavWeightMode" in " ".join(
        _problems({"loss": {"behavWeightMode": "sequence-mask"}}, actor={"backend": "archon:c2"})
    )
    assert _problems({"loss": {"behavWeightMode": "token-truncate"}}, actor={"backend": "archon:c2"}) == []


# -- dynamic sampling ---------------------------------------------------------------------


class _Episode:
    def __init__(self, group: int, member: int, informative: bool) -> None:
        self.group, self.member, self.informative = group, member, informative

    def prompt(self) -> list[int]:
        return [1, 8 + self.group]

    def respond(self, response: list[int]) -> tuple[list[int] | None, float]:
        # An informative group's members score 0, 1, 0, 1...; the others all score 1.
        return None, float(self.member % 2) if self.informative else 1.0


class _Task:
    """Single-turn episodes; ``informative`` names the group ids whose rewards differ."""

    vocab_size = 64
    max_new_tokens = 4
    stop_token_ids: tuple[int, ...] = ()

    def __init__(self, settings: TrainerSettings, step: int, informative: set[int]) -> None:
        self.group_of = {seed_of(settings.seed, step, g): g for g in range(100)}
        self.informative = informative
        self.made: dict[int, int] = {}

    def episode(self, seed: int) -> _Episode:
        g = self.group_of[seed]
        self.made[g] = self.made.get(g, 0) + 1
        return _Episode(g, self.made[g] - 1, g in self.informative)


def _collect(informative: set[int], groups: int = 4) -> tuple[Rollouts, list[int], list[str], dict[str, int]]:
    """Step 3 of a dapo run played inline by the group scheduler (bound 0), as the trainer does;
    returns the rollouts, the generate calls' seeds, the log lines and the dropped counts."""
    from treetrain.rl.rollout import Generation

    settings = TrainerSettings(algorithm="dapo", groups_per_step=groups, group_size=2)
    seeds: list[int] = []

    def generate(prompts: list[list[int]], params: Any, seed: int) -> list[Generation]:
        seeds.append(seed)
        return [Generation(tokens=[9, 10], logprobs=[-1.0, -1.0]) for _ in prompts]

    lines: list[str] = []
    keep = Algorithm(settings, actor=None).keep  # type: ignore[arg-type]  # only the keep rule is read
    scheduler = GroupScheduler(
        TaskSource(_Task(settings, 3, informative), generate, settings),  # type: ignore[arg-type]
        task="test",
        episode_timeout_s=60.0,
        groups_per_step=groups,
        max_staleness=0,
        steps=4,
        start_step=3,
        keep=keep,
        log=lines.append,
    )
    return scheduler.take(3), seeds, lines, scheduler.dropped


def test_dynamic_sampling_keeps_sampling_until_the_batch_is_full() -> None:
    # Round 0: groups 0-3, informative 1 and 3 (2 dropped). Round 1: 2 missing -> groups 4, 5:
    # 5 kept (3 dropped). Round 2: group 6, dropped (4). Round 3: group 7, kept: 4 groups.
    out, seeds, lines, dropped = _collect({1, 3, 5, 7})
    assert sorted(set(out.groups)) == [1, 3, 5, 7] and len(out.rewards) == 8
    assert dropped == {"filtered": 4, "failed": 0} and lines == []
    assert seeds[0] == seed_of(0, 3, 1_000_003, 0)  # the first round is seeded as without dynamic sampling
    assert len(set(seeds)) == 4  # each extra round has its own sampling seed
    assert sorted({s.episode for s in out.samples}) == list(range(8))  # renumbered episodes
    assert informative_groups(out.rewards, out.groups) == {1, 3, 5, 7}


def test_dynamic_sampling_stops_after_its_extra_groups() -> None:
    # groupsPerStep 2, only group 0 informative: extra groups 2..9 (4 x 2) all dropped.
    out, _, lines, dropped = _collect({0}, groups=2)
    assert sorted(set(out.groups)) == [0] and dropped["filtered"] == 1 + 8
    assert len(lines) == 1 and "step 4 trains 1 of 2 groups (10 tried" in lines[0]
    # Nothing informative at all: the first groups are trained (no signal), not an empty batch;
    # every group played and filtered counts as dropped, the first ones too.
    out, _, lines, dropped = _collect(set(), groups=2)
    assert sorted(set(out.groups)) == [0, 1] and dropped["filtered"] == 10
    assert "carry no signal" in lines[0]


def test_without_dynamic_sampling_every_group_is_kept() -> None:
    from treetrain.rl.rollout import Generation

    settings = TrainerSettings(groups_per_step=3, group_size=2)
    source = TaskSource(
        _Task(settings, 0, set()),  # type: ignore[arg-type]
        lambda prompts, params, seed: [Generation(tokens=[9], logprobs=[-1.0]) for _ in prompts],
        settings,
    )
    scheduler = GroupScheduler(source, task="test", episode_timeout_s=60.0, groups_per_step=3, max_staleness=0, steps=1)
    out = scheduler.take(0)
    assert out.groups == [0, 0, 1, 1, 2, 2] and scheduler.dropped["filtered"] == 0 and out.max_new_tokens == 4


# -- engines: per-sample reductions tree-packed vs flat -----------------------------------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from megatron_models import save_model

    yield save_model("qwen3", tmp_path_factory.mktemp("algorithms"))
    import torch.distributed as dist

    from treetrain.engines.megatron.parallel import reset_megatron

    reset_megatron()  # megatron-core needs a process group even for one process; leave none behind
    if dist.is_initialized():
        dist.destroy_process_group()


def _sequence_batch() -> TrainBatch:
    """The branching batch with what GSPO and a sequence weight mode read: per-sample
    advantages, old and behaviour log-probs (some samples' weights past the cap of 2),
    ``sample_index`` and sequence-mean ``loss_weights``."""
    from megatron_models import branching_sequences
    from megatron_models import make_batch as branching_batch

    batch = branching_batch(branching_sequences(), seed=2)
    g = torch.Generator().manual_seed(5)
    lengths = [int(m.sum()) for m in batch.loss_mask]
    total, count = sum(lengths), len(lengths)
    old = batch.fields.need("old_logprobs")
    fields = dataclasses.replace(
        batch.fields,
        behav_logprobs=[o - (1.5 if i % 3 == 0 else 0.3) * torch.rand(len(o), generator=g) for i, o in enumerate(old)],
        sample_index=[torch.full((len(o),), float(i)) for i, o in enumerate(old)],
        loss_weights=[torch.full((len(o),), total / (count * max(n, 1))) for o, n in zip(old, lengths, strict=True)],
    )
    return dataclasses.replace(batch, fields=fields)


@pytest.mark.parametrize("backend", ["fsdp:d1", "megatron:d1", "archon:d1"])
@pytest.mark.parametrize(
    "options",
    [{"ratio_level": "sequence", "behav_weight_mode": "sequence-mask"}, {"behav_weight_mode": "sequence-truncate"}],
    ids=["gspo-sequence-mask", "token-sequence-truncate"],
)
def test_sequence_reductions_tree_equals_flat(
    backend: str, options: dict[str, str], qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each sample's tokens sit in one micro-batch (64-token trees: several per batch), so the
    sequence ratio and weight see the whole sample: tree-packed, flat and each sequence alone
    through transformers agree (fp32, 1e-4)."""
    from megatron_models import reference

    from treetrain.engines import build_engine

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    settings = LossSettings(clip_eps=0.2, behav_imp_weight_cap=2.0, aggregation="sequence-mean", **options)  # type: ignore[arg-type]
    loss = PPOLoss(settings, behaviour=True)
    batch = _sequence_batch()
    ref_loss, ref_grads, _ = reference(qwen3, batch, loss)
    tree = TreeTrainingSettings(max_tokens_per_mb=64, block_size=16)
    engine = build_engine(ModelSettings(path=str(qwen3)), backend, tree=tree, optimizer=OptimizerSettings())
    runs = []
    for use_tree in (True, False):
        stats = engine.forward_backward(batch, loss, tree=use_tree)
        runs.append((stats, engine.full_grads()))
        engine.zero_grad()
    (ts, tg), (fs, fg) = runs
    assert ts.tree_tokens < fs.tree_tokens and ts.micro_batches > 1
    assert stats.stats.get("behav_dropped", stats.stats.get("behav_truncated", 0.0)) > 0  # the cap bites
    for got in (ts.loss, fs.loss):
        assert abs(got - ref_loss) <= 1e-4 * abs(ref_loss) + 1e-6
    for name, g in fg.items():
        torch.testing.assert_close(tg[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # Against each sequence alone: per parameter where the engine keeps Hugging Face names
    # (archon has its own), and the global gradient norm everywhere.
    for name, want in ref_grads.items():
        if name in tg:
            torch.testing.assert_close(tg[name], want, rtol=1e-4, atol=1e-6, msg=name)
    norm = torch.stack([g.norm() for g in tg.values()]).norm()
    want_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm()
    torch.testing.assert_close(norm, want_norm, rtol=1e-4, atol=0)


# -- the trainer --------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["rloo", "reinforce++", "dr-grpo", "dapo", "gspo"])
@pytest.mark.usefixtures("trainer_env")
def test_every_preset_trains(algorithm: str) -> None:
    """Each preset through the real trainer (tiny model, 2 steps): finite losses, and the
    sequence options reach the loss (gspo's ratio is 1 at one update per batch, exactly)."""
    from suite_helpers import small

    from treetrain import config as C
    from treetrain.trainer.loop import Trainer

    lines: list[str] = []
    trainer = Trainer(C.validate(small(algorithm=algorithm, steps=2)), log=lines.append)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    assert len(summary.records) == 2
    assert all(math.isfinite(r.loss) and math.isfinite(r.grad_norm) for r in summary.records)
    if algorithm == "gspo":
        assert all(r.stats["ratio"] == pytest.approx(1.0) for r in summary.records)
