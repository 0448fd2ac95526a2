"""A ``forward_backward``'s figures: the loss's stats summed over micro-batches and ranks
(:class:`StatTotals`, synced to the host once) and what the call returns (:class:`StepStats`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

MAX_SUFFIX = "_max"  # a loss stat named like this is a maximum over tokens, not a sum
LOSS_STAT = " loss"  # the loss itself, reduced with the stats (a name no loss stat takes)


class StatTotals:
    """A loss's stats summed over the micro-batches of one ``forward_backward`` (stats named
    ``*_max`` keep their maximum), reduced over ranks and synced to the host once.

    Sums are divided by the global token count (so they read as per-token means); maxima are
    not. Every rank must add the same stat names (the loss is the same everywhere)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}

    def add(self, stats: Mapping[str, torch.Tensor]) -> None:
        for name, value in stats.items():
            v = value.detach().float()
            if name.endswith(MAX_SUFFIX):
                self.maxima[name] = torch.maximum(self.maxima[name], v) if name in self.maxima else v
            else:
                self.sums[name] = self.sums[name] + v if name in self.sums else v

    def reduce(self, total: int, group: Any = None) -> dict[str, float]:
        """Per-token means and maxima over every rank of ``group`` (None: this process alone)."""
        import torch.distributed as dist

        sum_names, max_names = sorted(self.sums), sorted(self.maxima)
        sums = torch.stack([self.sums[k] for k in sum_names]) if sum_names else torch.zeros(0, device=self.device)
        maxima = torch.stack([self.maxima[k] for k in max_names]) if max_names else None
        if group is not None:
            dist.all_reduce(sums, group=group)
            if maxima is not None:
                dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        out = dict(zip(sum_names, (sums / total).tolist(), strict=True))  # host sync, for logging
        if maxima is not None:
            out.update(zip(max_names, maxima.tolist(), strict=True))
        return out


@dataclass(slots=True)
class StepStats:
    """Host figures of one ``forward_backward`` call (synced once, at its end)."""

    loss: float
    stats: dict[str, float]
    loss_tokens: int
    original_tokens: int
    tree_tokens: int
    padded_tokens: int
    micro_batches: int

    @property
    def tree_token_ratio(self) -> float:
        return self.tree_tokens / self.original_tokens if self.original_tokens else 1.0
