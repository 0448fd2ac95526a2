"""The engines' data contract: a training batch, and the per-token fields its losses read.

A :class:`TrainBatch` is plain per-sequence data in input order: the token ids, a loss mask and
typed per-token fields (:class:`TokenFields`), each one tensor of ``len(seq) - 1`` positions per
sequence (position ``i`` predicts token ``i + 1``). The engine packs it (tree or flat) and hands
the loss one micro-batch at a time, the same fields packed into ``[M]`` tensors in layout order
(:meth:`TokenFields.map`). A batch is frozen: the algorithm that builds it
(:class:`treetrain.rl.algorithm.Algorithm`) derives a new one for each preparation pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar

import torch

__all__ = ["LossInputError", "TokenFields", "TrainBatch"]

T = TypeVar("T")
U = TypeVar("U")


class LossInputError(ValueError):
    """A loss given a batch without a field its settings read."""


@dataclass(frozen=True, slots=True)
class TokenFields(Generic[T]):
    """The per-token inputs of the losses, each optional: in a batch one tensor per sequence
    (``T = list[torch.Tensor]``), in a micro-batch one ``[M]`` tensor in layout order."""

    advantages: T | None = None
    behav_logprobs: T | None = None  # the rollout sampler's own log-probs (decoupled PPO)
    old_logprobs: T | None = None  # the proximal policy: the weights before a step's first update
    ref_logprobs: T | None = None  # the reference model's (the KL term)
    returns: T | None = None  # the critic's targets
    old_values: T | None = None  # the critic's values before its update (value clipping)
    sample_index: T | None = None  # each position's sample (a sequence ratio or weight)
    loss_weights: T | None = None  # per-token aggregation weights (other than token-mean)

    def present(self) -> Iterator[tuple[str, T]]:
        """The fields that are set, by name."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield f.name, value

    def map(self, fn: Callable[[T], U]) -> TokenFields[U]:
        """The same fields with ``fn`` applied to each that is set."""
        return TokenFields(**{name: fn(value) for name, value in self.present()})

    def need(self, name: str) -> T:
        """The field ``name``; LossInputError when the batch does not carry it."""
        value: T | None = getattr(self, name)
        if value is None:
            raise LossInputError(f"the loss needs {name} in the batch; the algorithm that builds the batch adds it")
        return value


@dataclass(frozen=True, slots=True)
class TrainBatch:
    """Sequences, a loss mask, and per-token fields (each ``len(seq) - 1`` long, input order).

    ``loss_mask[i][t] = 1`` when token ``t + 1`` of sequence ``i`` is trained (a response token).
    """

    sequences: list[list[int]]
    loss_mask: list[torch.Tensor]
    fields: TokenFields[list[torch.Tensor]] = field(default_factory=TokenFields)

    def __post_init__(self) -> None:
        n = len(self.sequences)
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {n} sequences")
        for name, values in self.fields.present():
            if len(values) != n:
                raise ValueError(f"field {name!r} has {len(values)} entries for {n} sequences")
        for i, seq in enumerate(self.sequences):
            if len(seq) < 2:
                raise ValueError(f"sequence {i} has {len(seq)} token(s); a training sequence needs at least 2")
            if self.loss_mask[i].shape != (len(seq) - 1,):
                raise ValueError(
                    f"loss_mask[{i}] must have shape ({len(seq) - 1},), got {tuple(self.loss_mask[i].shape)}"
                )

    def num_loss_tokens(self) -> int:
        """Trained tokens of the whole batch (a host value: the batch lives on the host)."""
        return int(sum(int(m.sum()) for m in self.loss_mask))
