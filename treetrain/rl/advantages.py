"""Advantages and reward shaping: pure functions of the episodes' rewards and group ids.

``rewards[i]`` is episode ``i``'s reward and ``groups[i]`` its group (episodes of one group
share a seed: the same prompts). Torch-free, so the trainer, the asynchronous producer and the
tests call the same code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from treetrain.config.trainer_settings import AdvantageKind


def _members(rewards: Sequence[float], groups: Sequence[int]) -> dict[int, list[int]]:
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids")
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return members


def group_advantages(
    rewards: Sequence[float], groups: Sequence[int], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO: each reward minus its group's mean, over the group's standard deviation.

    The standard deviation is the population one (``1/n``); a group whose rewards are all
    equal gets zero advantages (no signal, no division by zero).
    """
    out = [0.0] * len(rewards)
    for idx in _members(rewards, groups).values():
        vals = [float(rewards[i]) for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        for i, v in zip(idx, vals, strict=True):
            out[i] = (v - mean) / (std + eps) if normalize_std else v - mean
    return out


def rloo_advantages(
    rewards: Sequence[float], groups: Sequence[int], *, normalize_std: bool = False, eps: float = 1e-6
) -> list[float]:
    """RLOO: each reward minus the mean of the *other* rewards of its group (a group of one
    has no others: advantage 0); with ``normalize_std`` divided by the group's population
    standard deviation, as GRPO."""
    out = [0.0] * len(rewards)
    for idx in _members(rewards, groups).values():
        vals = [float(rewards[i]) for i in idx]
        n, total = len(vals), sum(vals)
        if n < 2:
            continue
        mean = total / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / n)
        for i, v in zip(idx, vals, strict=True):
            a = v - (total - v) / (n - 1)
            out[i] = a / (std + eps) if normalize_std else a
    return out


def reinforce_baseline_advantages(
    rewards: Sequence[float], groups: Sequence[int], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """REINFORCE++-baseline: each reward minus its group's mean, then (``normalize_std``)
    divided by the population standard deviation of those differences over the whole batch
    (not per group: a group with a small spread is not blown up)."""
    centred = group_advantages(rewards, groups, normalize_std=False)
    if not normalize_std or not centred:
        return centred
    mean = sum(centred) / len(centred)
    std = math.sqrt(sum((a - mean) ** 2 for a in centred) / len(centred))
    return [a / (std + eps) for a in centred]


def advantages(
    kind: AdvantageKind, rewards: Sequence[float], groups: Sequence[int], *, normalize_std: bool
) -> list[float]:
    """Per-episode advantages of ``kind``; ``critic`` returns the rewards themselves (the
    trainer replaces them with return minus value once the critic has run)."""
    if kind == "group":
        return group_advantages(rewards, groups, normalize_std=normalize_std)
    if kind == "rloo":
        return rloo_advantages(rewards, groups, normalize_std=normalize_std)
    if kind == "reinforce++-baseline":
        return reinforce_baseline_advantages(rewards, groups, normalize_std=normalize_std)
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids")
    return [float(r) for r in rewards]


def informative_groups(rewards: Sequence[float], groups: Sequence[int]) -> set[int]:
    """Dynamic sampling (DAPO): the groups whose rewards are not all equal. A group whose
    episodes all scored the same has zero group-relative advantage: no learning signal."""
    return {g for g, idx in _members(rewards, groups).items() if len({float(rewards[i]) for i in idx}) > 1}


def overlong_penalty(length: int, max_length: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of one reply of ``length`` tokens: 0 up to
    ``max_length - buffer``, then falling linearly to ``-penalty`` at ``max_length`` (and
    ``-penalty`` past it)."""
    if buffer < 1:
        raise ValueError(f"the overlong buffer must be at least 1 token, got {buffer}")
    start = max_length - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer)
