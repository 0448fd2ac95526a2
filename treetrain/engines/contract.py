"""What the engine core, the engines' schedules and the losses exchange: the roles, one
micro-batch's outputs (:class:`MicroBatchOutput`), the loss protocol (:class:`Loss`) and what a
schedule hands the core for each micro-batch (:class:`MicroBatchRun`). The batch itself is
:mod:`treetrain.engines.batch`.

Letters: M gathered positions of one micro-batch (each sequence contributes ``len - 1``:
position ``i`` predicts token ``i + 1``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from treetrain.engines.batch import TokenFields
from treetrain.engines.errors import EngineConfigError
from treetrain.tree import PackedTree

# actor: trained, log-probs; critic: trained, values; ref: frozen, log-probs.
ROLES = ("actor", "critic", "ref")


def check_role(role: str) -> None:
    if role not in ROLES:
        raise EngineConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")


@dataclass(slots=True)
class MicroBatchOutput:
    """What the loss sees for one micro-batch, all ``[M]`` in layout order."""

    logprobs: torch.Tensor | None = None  # fp32, with grad
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None  # critic: value of the state before token i + 1


class Loss(Protocol):
    """A per-micro-batch loss: returns the *sum* over masked tokens and stat sums.

    The engine divides both by the global token count. Stat values are 0-d tensors (no host
    sync here); the engine adds them up and syncs once per step.
    """

    needs_entropy: bool

    def __call__(
        self, out: MicroBatchOutput, loss_mask: torch.Tensor, inputs: TokenFields[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclass(slots=True)
class MicroBatchRun:
    """One micro-batch's outputs on this rank, what an engine's schedule hands the core.

    ``sel_M``: which of the tree's M gathered positions this rank holds (context parallel:
    the positions whose predicting row is on this rank; None: all of them, in order).
    ``anchor``: a zero that touches every output row, so that backward reaches every layer
    and collective even when this rank gathered nothing. ``aux``: a loss term of the whole
    micro-batch outside the token loss (the MoE load-balancing loss, already weighted)."""

    tree: PackedTree
    out: MicroBatchOutput
    anchor: torch.Tensor
    sel_M: torch.Tensor | None = None
    aux: torch.Tensor | None = None


# Called by a schedule for micro-batch ``i`` (on the last pipeline stage); training: returns
# the scalar to backward, already scaled; forward only: None.
OnRun = Callable[[int, MicroBatchRun], "torch.Tensor | None"]
