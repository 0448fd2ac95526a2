"""What a rollout hands the trainer: samples, token-aligned, grouped into episodes and groups.

A :class:`Sample` is one trained sequence in one form from the sampler to the batch: its token
ids, the sampler's log-prob of each token (0.0 on the prompt's tokens) and the first trained
token; a task's turn and an agent's completion (the proxy's record) both give it directly, and
the algorithm shifts it into the batch's per-position tensors (position ``i`` predicts token
``i + 1``). :class:`Rollouts` are a step's (or a group's) samples with the episodes' rewards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Sample:
    """One trained sequence: ``tokens[prompt_len:]`` were sampled (the reply) and are trained;
    ``logprobs[i]`` is the sampler's log-prob of ``tokens[i]`` (0.0 before ``prompt_len``);
    ``version`` is the oldest weight version its episode was sampled with, up to this turn."""

    episode: int
    tokens: list[int]
    prompt_len: int
    logprobs: list[float]
    version: int = 0

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.tokens):
            raise ValueError(f"a sample has {len(self.tokens)} tokens but {len(self.logprobs)} log-probs")

    @property
    def reply_len(self) -> int:
        """The trained tokens: the last reply."""
        return len(self.tokens) - self.prompt_len


@dataclass(slots=True)
class Rollouts:
    samples: list[Sample]
    rewards: list[float]  # per episode: mean reward over its turns
    groups: list[int]  # per episode: its GRPO group
    capped_turns: int = 0  # episodes ended at trainer.maxTurns
    capped_tokens: int = 0  # episodes ended before passing trainer.maxEpisodeTokens
    max_new_tokens: int = 0  # the task's reply length (overlong penalty, constant-length aggregation)

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / max(len(self.rewards), 1)


def seed_of(*parts: int) -> int:
    """A stable 63-bit seed from integers (Python's hash of ints is stable, but spell it out)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p + 0x9E3779B97F4A7C15 + (x << 6) + (x >> 2))) & ((1 << 63) - 1)
    return x


def reply_lengths(rollouts: Rollouts) -> list[int]:
    """Each sample's trained tokens: its last reply."""
    return [s.reply_len for s in rollouts.samples]


def select_groups(rollouts: Rollouts, keep: set[int]) -> Rollouts:
    """The episodes of ``rollouts`` whose group is in ``keep``, renumbered in order (counts kept)."""
    index = {e: i for i, e in enumerate(e for e, g in enumerate(rollouts.groups) if g in keep)}
    return Rollouts(
        samples=[dataclasses.replace(s, episode=index[s.episode]) for s in rollouts.samples if s.episode in index],
        rewards=[r for r, g in zip(rollouts.rewards, rollouts.groups, strict=True) if g in keep],
        groups=[g for g in rollouts.groups if g in keep],
        capped_turns=rollouts.capped_turns,
        capped_tokens=rollouts.capped_tokens,
        max_new_tokens=rollouts.max_new_tokens,
    )


def merge_rollouts(parts: Sequence[Rollouts]) -> Rollouts:
    """Several groups' rollouts as one: episode indices renumbered in order, counts summed."""
    samples: list[Sample] = []
    rewards: list[float] = []
    groups: list[int] = []
    for part in parts:
        base = len(rewards)
        samples += [dataclasses.replace(s, episode=base + s.episode) for s in part.samples]
        rewards += part.rewards
        groups += part.groups
    return Rollouts(
        samples=samples,
        rewards=rewards,
        groups=groups,
        capped_turns=sum(p.capped_turns for p in parts),
        capped_tokens=sum(p.capped_tokens for p in parts),
        max_new_tokens=max((p.max_new_tokens for p in parts), default=0),
    )


def rollouts_json(r: Rollouts) -> dict[str, Any]:
    """``r`` as JSON-able data (the rollout state a checkpoint keeps)."""
    return dataclasses.asdict(r)


def rollouts_of(raw: dict[str, Any]) -> Rollouts:
    """The inverse of :func:`rollouts_json`."""
    return Rollouts(**{**raw, "samples": [Sample(**s) for s in raw["samples"]]})
