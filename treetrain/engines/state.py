"""What every part of an engine reads: the attributes :class:`treetrain.engines.base.Engine`'s
constructor sets, declared once for the parts the core is split into (the optimizer step,
checkpoints, the local-rollout sampler) and for the engines."""

from __future__ import annotations

from abc import ABC
from typing import Any

import torch

from treetrain.alloc.precision import Precision
from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
from treetrain.config.lora import LoraSettings
from treetrain.engines.layout import Layout
from treetrain.engines.source import ModelSource


class EngineState(ABC):
    """The state of one engine on this rank (set by ``Engine.__init__``)."""

    # What the trainer reads of every engine.
    layout: Layout  # this process's place in the backend's grid (the layout protocol)
    model: torch.nn.Module  # the (sharded) module; local rollout samples from an actor's
    attention: str  # the tree attention backend in use (resolved from the config's name)
    steps: int  # optimizer steps taken (restored by load)
    # What the core's packing, step, checkpoints and sampler read.
    source: ModelSource  # the model, ``model.dtype: auto`` resolved for this device
    settings: ModelSettings
    role: str
    tree: TreeTrainingSettings
    block_size: int
    optim: OptimizerSettings | None  # None: forward only (a reference model)
    optimizer: torch.optim.Optimizer | None
    precision: Precision  # the dtypes this engine computes in and keeps its weights in
    lora: LoraSettings | None  # a LoRA adapter over the frozen base (None: every weight trains)
    lora_targets: tuple[str, ...]  # the projections it adapts in this model

    def lora_summary(self) -> dict[str, Any] | None:
        """What a checkpoint records of the adapter (a resume needs the same)."""
        if self.lora is None:
            return None
        return {"rank": self.lora.rank, "alpha": self.lora.lora_alpha, "targets": list(self.lora_targets)}

    @property
    def engine_name(self) -> str:
        """The backend prefix (the registry's name of this engine); written into checkpoints."""
        return self.layout.allocation.backend
