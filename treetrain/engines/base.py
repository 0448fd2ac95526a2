"""The engine core's lifecycle, written once for every training engine (FSDP, Megatron,
Archon): construction, packing, ``forward`` and ``forward_backward`` over micro-batches. The
rest of the core is split by job: the optimizer step (:mod:`.optim`), checkpoint I/O
(:mod:`.checkpoint`), the local-rollout sampler (:mod:`.sampler`), the stats
(:mod:`.stats`), what schedules and losses exchange (:mod:`.contract`) and the batch
(:mod:`.batch`). Every layout question is the layout protocol's (:mod:`.layout`).

Letters: M gathered positions of one micro-batch (each sequence contributes ``len - 1``:
position ``i`` predicts token ``i + 1``), S sequences.

A :class:`TrainBatch` is plain per-sequence data in input order. The engine packs it (tree
or flat), hands the loss one micro-batch at a time in *layout order* (the order of the
gathered log-probs), and divides every micro-batch's loss sum by one global token count that
it fixes before the micro-batch loop, so uneven micro-batches still give the batch mean.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from treetrain.alloc import Allocation
from treetrain.alloc.lora import LoraTargetError, valid_targets
from treetrain.alloc.precision import precision, resolve_dtype
from treetrain.attention import resolve
from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
from treetrain.config.lora import LoraSettings
from treetrain.engines.batch import TrainBatch
from treetrain.engines.checkpoint import Checkpoints
from treetrain.engines.contract import Loss, MicroBatchRun, OnRun, check_role
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.layout import Layout
from treetrain.engines.lora import Adapters
from treetrain.engines.optim import Optimization, adamw
from treetrain.engines.source import ModelSource
from treetrain.engines.stats import LOSS_STAT, StatTotals, StepStats
from treetrain.logprob import pack_sequence_tensors, unpack_sequence_tensors
from treetrain.tree import PackConfig, PackedBatch, PackedTree, pack

ADAPTER_DIR = "adapter"  # a LoRA checkpoint's PEFT adapter directory


def with_dtype_resolved(source: ModelSource, device: torch.device) -> ModelSource:
    """``source`` with ``model.dtype: auto`` resolved for ``device``: bfloat16 on CUDA, float32
    on the CPU (:func:`treetrain.alloc.precision.resolve_dtype`); every engine builds from it."""
    dtype = resolve_dtype(source.settings.dtype, cuda=device.type == "cuda")
    if dtype == source.settings.dtype:
        return source
    return replace(source, settings=source.settings.model_copy(update={"dtype": dtype}))


class Engine(Checkpoints, Optimization, Adapters):
    """Build from a model and a parallel layout; train with or without tree packing.

    The core owns the lifecycle once: the constructor prologue, ``forward`` and
    ``forward_backward`` over micro-batches (stats through :class:`StatTotals`, every layout
    question asked of :attr:`layout`), ``step`` with one gradient norm, ``save`` / ``load``
    (every RNG state, the torn-checkpoint error the trainer's fallback needs) and the
    local-rollout sampler. An engine supplies a handful of hooks: its layout
    (:meth:`init_layout`), its model (:meth:`_build`), how one micro-batch runs (:meth:`_run`,
    or a pipeline :meth:`_schedule` of them) and its Hugging Face export (:meth:`export_hf`);
    where it differs, which gradients it holds (:meth:`_grad_pieces`), how its state reaches
    and leaves the disk (:meth:`_write`, :meth:`_read`) and what local rollout samples from
    (:meth:`_sampler_weights`)."""

    @staticmethod
    @abstractmethod
    def init_layout(allocation: Allocation) -> Layout:
        """This engine's layout of ``allocation``: joins the process group (once per process)
        and builds the engine's meshes or groups; the factory calls it before the constructor."""

    def __init__(
        self,
        model: ModelSettings | ModelSource,
        layout: Layout,
        tree: TreeTrainingSettings,
        optimizer: OptimizerSettings | None = None,
        *,
        role: str = "actor",
        lora: LoraSettings | None = None,
    ) -> None:
        """Everything every engine checks and sets before it builds its model: the role, the
        resolved model source, the tree settings, the engine's own layout checks
        (:meth:`_prepare`), the attention backend (a trained role needs one with a backward
        on this device: that fails here, not in the first step) and the packer's capacity;
        then the engine's model (:meth:`_build`) and optimizer (:meth:`_build_optimizer`).
        ``lora``: train an adapter over the frozen base (an actor's; docs/engines.md, LoRA)."""
        check_role(role)
        source = model if isinstance(model, ModelSource) else ModelSource.resolve(model)
        self.source = with_dtype_resolved(source, layout.device)
        self.settings = self.source.settings
        self.layout = layout
        self.lora = lora
        self.lora_targets = self._resolve_lora(lora, role)
        self.precision = precision(self.engine_name, layout.allocation.dims, self.settings.dtype, lora=lora is not None)
        self.tree = tree
        self.role = role
        self.block_size = tree.block_size
        self._prepare()
        self.attention = resolve(tree.attention, layout.device, needs_grad=optimizer is not None)
        self._pack_config(tree=True)  # the packer's message when max_tokens_per_mb does not fit
        self.optim = optimizer
        self.steps = 0
        self._sampler = None
        self._build()
        if lora is not None:
            self._init_adapter()  # B = 0: the adapted model starts as the base
        self.optimizer = self._build_optimizer(optimizer)

    def _prepare(self) -> None:
        """Engine checks of the model against the layout, before anything is built."""
        return

    def _resolve_lora(self, lora: LoraSettings | None, role: str) -> tuple[str, ...]:
        """The projections ``lora`` adapts in this model (its ``model_type``'s)."""
        if lora is None:
            return ()
        if role != "actor":
            raise EngineConfigError(f"LoRA trains the actor; the {role} is built without it")
        family = str(getattr(self.source.config, "model_type", ""))
        try:
            return lora.targets(valid_targets(family), model=f"a {family} model")
        except LoraTargetError as err:
            raise EngineConfigError(f"actor.lora: {err}") from None

    @abstractmethod
    def _build(self) -> None:
        """Build this rank's :attr:`model` (and what the engine derives from it)."""

    def _build_optimizer(self, settings: OptimizerSettings | None) -> torch.optim.Optimizer | None:
        """The optimizer, once :attr:`model` is built (None: forward only)."""
        return adamw(self.model, settings)

    def save(self, path: Path, extra: Mapping[str, Any]) -> None:
        """A resumable checkpoint (the core's :meth:`Checkpoints.save`); with LoRA it holds the
        adapter and its optimizer state only, plus the adapter as a PEFT directory (``adapter/``)."""
        super().save(path, extra)
        if self.lora is not None:
            self.export_adapter(path / ADAPTER_DIR)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (a task's token ids must stay below it)."""
        return int(self.source.config.vocab_size)

    # -- packing ---------------------------------------------------------------------------
    def _pack_config(self, *, tree: bool) -> PackConfig:
        """Trees aligned to the block and to the ranks that split a tree's tokens (tensor /
        sequence parallel times context parallel: :attr:`treetrain.alloc.Allocation.alignment`,
        the size config validation checked the micro-batch cap against), spread over the
        data-parallel ranks."""
        return PackConfig(
            max_tokens_per_mb=self.tree.max_tokens_per_mb,
            block_size=self.block_size,
            parallel_size=self.layout.allocation.alignment,
            dp_size=self.layout.dp,
            pad_to_max=self.tree.pad_to_maximum,
            share_prefixes=tree,
        )

    def pack(self, sequences: Sequence[Sequence[int]], *, tree: bool | None = None) -> PackedBatch:
        use_tree = self.tree.enabled if tree is None else tree
        return pack(sequences, self._pack_config(tree=use_tree))

    # -- micro-batches: the hooks ------------------------------------------------------------
    def _micro_batches(self, packed: PackedBatch) -> list[PackedTree]:
        """This rank's trees, in the order its schedule runs them."""
        return packed.rank_trees(self.layout.dp_rank)

    def _run(self, tree: PackedTree, *, entropy: bool) -> MicroBatchRun:
        """One micro-batch through the whole model (engines without their own schedule)."""
        raise NotImplementedError(f"{type(self).__name__} runs micro-batches through its own _schedule")

    def _schedule(self, trees: Sequence[PackedTree], on_run: OnRun, *, entropy: bool, train: bool) -> None:
        """Run every micro-batch, hand each one's outputs to ``on_run`` and (``train``)
        backward what it returns. The default: one after the other through :meth:`_run`."""
        for i, tree in enumerate(trees):
            scalar = on_run(i, self._run(tree, entropy=entropy))
            if train and scalar is not None:
                torch.autograd.backward(scalar)

    def _after_backward(self) -> None:
        """Complete the gradients after the last micro-batch (sums over ranks)."""
        return

    # -- forward_backward and forward ------------------------------------------------------
    def forward_backward(self, batch: TrainBatch, loss: Loss, *, tree: bool | None = None) -> StepStats:
        """Accumulate gradients of ``loss`` over ``batch``; ``tree`` overrides the config.

        One global token count, fixed before the micro-batch loop (every rank holds the whole
        batch), divides every micro-batch's loss sum, so uneven micro-batches and ranks still
        give the gradient of the batch mean."""
        if self.optimizer is None:
            raise RuntimeError(f"the {self.role} engine was built without an optimizer: it cannot train")
        self.model.train()
        layout = self.layout
        packed = self.pack(batch.sequences, tree=tree)
        total = max(batch.num_loss_tokens(), 1)
        scale = layout.grad_average / total
        device = layout.device
        totals = StatTotals(device)
        trees = self._micro_batches(packed)

        def on_run(i: int, run: MicroBatchRun) -> torch.Tensor:
            mask_M = pack_sequence_tensors(run.tree, batch.loss_mask).to(device)
            inputs = batch.fields.map(lambda v: pack_sequence_tensors(run.tree, v).to(device))
            if run.sel_M is not None:
                sel_M = run.sel_M
                mask_M = mask_M[sel_M]
                inputs = inputs.map(lambda v: v[sel_M])
            mb_loss, stats = loss(run.out, mask_M, inputs)
            totals.add({LOSS_STAT: mb_loss, **stats})
            # The auxiliary loss is a mean per micro-batch: weighted to count once per batch.
            extra = run.anchor if run.aux is None else run.anchor + run.aux * total / len(trees)
            return (mb_loss + extra) * scale

        self._schedule(trees, on_run, entropy=loss.needs_entropy, train=True)
        self._after_backward()
        host = self._reduce_stats(totals, total)
        s = packed.stats
        return StepStats(
            loss=host.pop(LOSS_STAT, 0.0),
            stats=host,
            loss_tokens=batch.num_loss_tokens(),
            original_tokens=s.original_tokens,
            tree_tokens=s.tree_tokens,
            padded_tokens=s.padded_tokens,
            micro_batches=len(trees),
        )

    def _reduce_stats(self, totals: StatTotals, total: int) -> dict[str, float]:
        """Means and maxima over the last stage's data x context ranks, then known on every rank."""
        import torch.distributed as dist

        host = totals.reduce(total, self.layout.group("dp_cp")) if self.layout.last_stage else {}
        pp = self.layout.group("pp")
        if pp is not None:
            got: list[Any] = [host]
            dist.broadcast_object_list(got, group=pp, group_src=self.layout.pp - 1)
            host = got[0]
        return host

    @torch.no_grad()
    def forward(self, batch: Sequence[Sequence[int]], *, tree: bool | None = None) -> list[torch.Tensor]:
        """Per-sequence log-probs (actor, ref) or values (critic), fp32, ``len - 1`` each, no
        grad, on the CPU, in input order, on every rank."""
        import torch.distributed as dist

        if not batch:
            return []
        self.model.eval()
        packed = self.pack(batch, tree=tree)
        lengths = [len(s) - 1 for s in batch]
        mine: dict[int, torch.Tensor] = {}
        cp = self.layout.group("cp")

        def collect(i: int, run: MicroBatchRun) -> None:
            part = run.out.values if self.role == "critic" else run.out.logprobs
            assert part is not None
            flat = part.float()
            if run.sel_M is not None:  # context ranks: each holds some positions; add them up
                flat = torch.zeros(run.sel_M.shape[0], device=part.device).masked_scatter_(run.sel_M, flat)
                if cp is not None:
                    dist.all_reduce(flat, group=cp)
            mine.update(unpack_sequence_tensors(run.tree, flat.cpu(), lengths))

        self._schedule(self._micro_batches(packed), collect, entropy=False, train=False)
        if self.layout.world_size > 1:  # every data rank's sequences to every rank, once
            every: list[Any] = [None] * self.layout.world_size
            dist.all_gather_object(every, mine if self.layout.owns_outputs else {})
            for part in every:
                mine.update(part)
        return [mine[i] for i in range(len(batch))]
