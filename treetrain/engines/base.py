"""The engine interface every training backend (FSDP, Megatron, Archon) implements.

Letters: M gathered positions of one micro-batch (each sequence contributes ``len - 1``:
position ``i`` predicts token ``i + 1``), S sequences.

A :class:`TrainBatch` is plain per-sequence data in input order. The engine packs it (tree
or flat), hands the loss one micro-batch at a time in *layout order* (the order of the
gathered log-probs), and divides every micro-batch's loss sum by one global token count that
it fixes before the micro-batch loop, so uneven micro-batches still give the batch mean.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from treetrain.config import OptimizerSettings, TreeTrainingSettings
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.parallel import ParallelLayout
from treetrain.tree import PackConfig, PackedBatch, pack

__all__ = ["ROLES", "Engine", "EngineConfigError", "Loss", "MicroBatchOutput", "StepStats", "TrainBatch", "check_role"]

# actor: trained, log-probs; critic: trained, values; ref: frozen, log-probs.
ROLES = ("actor", "critic", "ref")


def check_role(role: str) -> None:
    if role not in ROLES:
        raise EngineConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")


@dataclass(slots=True)
class TrainBatch:
    """Sequences plus per-token tensors (each ``len(seq) - 1`` long, input order).

    ``loss_mask[i][t] = 1`` when token ``t + 1`` of sequence ``i`` is trained (a response
    token). ``tensors`` holds whatever the loss reads (``advantages``, ``old_logprobs``,
    ``behav_logprobs``, ``ref_logprobs``, ``returns``, ``old_values``...).
    """

    sequences: list[list[int]]
    loss_mask: list[torch.Tensor]
    tensors: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.sequences)
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {n} sequences")
        for name, values in self.tensors.items():
            if len(values) != n:
                raise ValueError(f"tensor {name!r} has {len(values)} entries for {n} sequences")
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
        self, out: MicroBatchOutput, loss_mask: torch.Tensor, inputs: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def adamw(model: torch.nn.Module, settings: Any) -> torch.optim.Optimizer | None:
    """The optimizer every engine trains with (``settings``: an ``OptimizerSettings``, or None
    for a forward-only engine, whose parameters then need no gradient)."""
    if settings is None:
        model.requires_grad_(False)
        return None
    return torch.optim.AdamW(
        model.parameters(),
        lr=settings.lr,
        betas=(settings.betas[0], settings.betas[1]),
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )


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


class Engine(ABC):
    """Build from a model and a parallel strategy; train with or without tree packing."""

    # What the trainer reads of every engine.
    layout: ParallelLayout  # this process's place in the backend's grid
    model: torch.nn.Module  # the (sharded) module; local rollout samples from an actor's
    attention: str  # the tree attention backend in use (resolved from the config's name)
    steps: int  # optimizer steps taken (restored by load)
    # What the shared packing and optimizer step below read.
    role: str
    tree: TreeTrainingSettings
    block_size: int
    optim: OptimizerSettings | None  # None: forward only (a reference model)
    optimizer: torch.optim.Optimizer | None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The model's vocabulary size (a task's token ids must stay below it)."""

    def sampling_model(self) -> torch.nn.Module:
        """What local rollout samples from: a module called like a Hugging Face causal LM
        (attention masks, KV caches), kept up to date with the trained weights. The default is
        :attr:`model` itself (a transformers model); engines with their own models return one."""
        return self.model

    @abstractmethod
    def forward_backward(self, batch: TrainBatch, loss: Loss, *, tree: bool | None = None) -> StepStats:
        """Accumulate gradients of ``loss`` over ``batch``; ``tree`` overrides the config."""

    @abstractmethod
    def forward(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per-sequence log-probs (actor) or values (critic), no grad, input order."""

    # -- packing ---------------------------------------------------------------------------
    def _pack_config(self, *, tree: bool) -> PackConfig:
        """Trees aligned to the block and to the ranks that split a tree's tokens (tensor /
        sequence parallel times context parallel: ``treetrain.config.alignment_size``), spread
        over the data-parallel ranks."""
        return PackConfig(
            max_tokens_per_mb=self.tree.max_tokens_per_mb,
            block_size=self.block_size,
            parallel_size=self.layout.tp * self.layout.cp,
            dp_size=self.layout.dp,
            pad_to_max=self.tree.pad_to_maximum,
            share_prefixes=tree,
        )

    def pack(self, sequences: Sequence[Sequence[int]], *, tree: bool | None = None) -> PackedBatch:
        use_tree = self.tree.enabled if tree is None else tree
        return pack(sequences, self._pack_config(tree=use_tree))

    # -- the optimizer step ----------------------------------------------------------------
    @abstractmethod
    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients (one collective; every distinct shard once)."""

    def step(self) -> float:
        """Clip the gradients to ``max_grad_norm`` (one all-reduce, one host sync), apply AdamW
        with the warm-up learning rate, zero the gradients; returns the norm before clipping."""
        if self.optimizer is None or self.optim is None:
            raise RuntimeError(f"the {self.role} engine was built without an optimizer: it cannot step")
        cfg = self.optim
        norm = float(self.grad_norm())  # host sync: once per step, logged too
        if cfg.max_grad_norm > 0 and norm > cfg.max_grad_norm:
            scale_grads(self.model.parameters(), cfg.max_grad_norm / (norm + 1e-6))
        warm = cfg.warmup_steps
        lr = cfg.lr * min(1.0, (self.steps + 1) / warm) if warm else cfg.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self._refresh_sampler()
        return norm

    def _refresh_sampler(self) -> None:
        """Bring :meth:`sampling_model` up to the new weights (after a step or a load); the
        default model is :attr:`model` itself, always current."""
        return

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    @abstractmethod
    def save(self, path: Path, extra: Mapping[str, Any]) -> None:
        """A resumable checkpoint: model, optimizer, scheduler, RNG, and ``extra``."""

    @abstractmethod
    def load(self, path: Path) -> dict[str, Any]:
        """Restore what :meth:`save` wrote; returns its ``extra``."""

    @abstractmethod
    def export_hf(self, path: Path) -> None:
        """Hugging Face weights (safetensors + config) for rollout servers to load."""

    def hf_weights(self) -> dict[str, torch.Tensor] | None:
        """The full Hugging Face weights by name on the main rank (None on the others), what a
        distributed weight sync broadcasts; every rank calls it. The default goes through
        :meth:`export_hf` and a temporary directory; engines that gather directly override it."""
        import tempfile

        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory(prefix="treetrain-weights-") as tmp:
            self.export_hf(Path(tmp))
            if not self.layout.is_main:
                return None
            state: dict[str, torch.Tensor] = {}
            for f in sorted(Path(tmp).glob("*.safetensors")):
                state.update(load_file(f))
            return state


def scale_grads(params: Iterable[torch.Tensor], coef: float) -> None:
    """Multiply every gradient in place (each rank its local shards; a pending sum's parts
    scale its sum)."""
    grads = []
    for p in params:
        g = p.grad
        if g is not None:
            local = g.to_local() if isinstance(g, DTensor) else g
            if local.numel():
                grads.append(local)
    if grads:
        torch.foreach.mul_(grads, coef)
