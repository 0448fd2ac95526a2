"""Rollout collection and batch building: episodes played turn by turn, then one training
batch whose samples (every turn of every episode) share prefixes, so they pack into trees.

Pure of torch.distributed: ``generate`` is whatever gives one generation per prompt (the
trainer's rank-0 rollout broadcast to every rank, or a client directly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from treetrain.config import TrainerSettings
from treetrain.engines.base import TrainBatch
from treetrain.rl.losses import group_advantages
from treetrain.rl.rollout import Generation, SamplingParams
from treetrain.rl.task import Task

Generate = Callable[[list[list[int]], SamplingParams, int], list[Generation]]


@dataclass(slots=True)
class Sample:
    episode: int
    tokens: list[int]
    prompt_len: int
    behav_logprobs: list[float]


@dataclass(slots=True)
class Rollouts:
    samples: list[Sample]
    rewards: list[float]  # per episode: mean reward over its turns
    groups: list[int]  # per episode: its GRPO group

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / max(len(self.rewards), 1)


def seed_of(*parts: int) -> int:
    """A stable 63-bit seed from integers (Python's hash of ints is stable, but spell it out)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p + 0x9E3779B97F4A7C15 + (x << 6) + (x >> 2))) & ((1 << 63) - 1)
    return x


def collect_rollouts(task: Task, generate: Generate, settings: TrainerSettings, step: int) -> Rollouts:
    """Play ``groupsPerStep`` groups of ``groupSize`` episodes to the end, all active episodes
    of a turn in one ``generate`` call; every turn becomes one sample holding the whole
    conversation so far. A group's episodes share their seed (same prompts, GRPO)."""
    t = settings
    params = SamplingParams(
        max_new_tokens=task.max_new_tokens,
        temperature=t.rollout.temperature,
        top_p=t.rollout.top_p,
        stop_token_ids=tuple(getattr(task, "stop_token_ids", ())),
    )
    episodes, groups = [], []
    for g in range(t.groups_per_step):
        for _ in range(t.group_size):
            episodes.append(task.episode(seed_of(t.seed, step, g)))
            groups.append(g)
    history = [ep.prompt() for ep in episodes]
    totals = [0.0] * len(episodes)
    turns = [0] * len(episodes)
    active = list(range(len(episodes)))
    samples: list[Sample] = []
    turn = 0
    while active:
        gens = generate([history[i] for i in active], params, seed_of(t.seed, step, 1_000_003, turn))
        still = []
        for i, gen in zip(active, gens, strict=True):
            tokens = history[i] + gen.tokens
            samples.append(Sample(episode=i, tokens=tokens, prompt_len=len(history[i]), behav_logprobs=gen.logprobs))
            nxt, reward = episodes[i].respond(list(gen.tokens))
            totals[i] += reward
            turns[i] += 1
            if nxt is not None:
                history[i] = tokens + list(nxt)
                still.append(i)
        active = still
        turn += 1
    rewards = [total / max(n, 1) for total, n in zip(totals, turns, strict=True)]
    return Rollouts(samples=samples, rewards=rewards, groups=groups)


def make_batch(rollouts: Rollouts, settings: TrainerSettings) -> TrainBatch:
    """The training batch: response tokens masked in, GRPO advantages (or PPO returns, whose
    advantages the critic fills in), and the sampler's log-probs for decoupled PPO."""
    if settings.algorithm == "grpo":
        adv = group_advantages(rollouts.rewards, rollouts.groups, normalize_std=settings.normalize_advantages)
    else:
        adv = rollouts.rewards
    seqs, masks, advs, behav, returns = [], [], [], [], []
    for s in rollouts.samples:
        n = len(s.tokens) - 1
        mask = torch.zeros(n)
        mask[s.prompt_len - 1 :] = 1.0  # position i predicts token i + 1: the response tokens
        b = torch.zeros(n)
        b[s.prompt_len - 1 :] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
        seqs.append(s.tokens)
        masks.append(mask)
        advs.append(torch.full((n,), float(adv[s.episode])))
        returns.append(torch.full((n,), float(rollouts.rewards[s.episode])))
        behav.append(b)
    tensors: dict[str, list[torch.Tensor]] = {"advantages": advs, "behav_logprobs": behav}
    if settings.algorithm == "ppo":
        tensors["returns"] = returns
    return TrainBatch(sequences=seqs, loss_mask=masks, tensors=tensors)
