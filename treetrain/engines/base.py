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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from treetrain.alloc import Allocation
from treetrain.alloc.precision import Precision, precision, resolve_dtype
from treetrain.attention import resolve
from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
from treetrain.engines import checkpoint_files as files
from treetrain.engines.batch import TokenFields, TrainBatch
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.grads import dtensor_pieces, global_norm
from treetrain.engines.parallel import ParallelLayout, init_distributed
from treetrain.engines.source import ModelSource
from treetrain.logprob import pack_sequence_tensors, unpack_sequence_tensors
from treetrain.tree import PackConfig, PackedBatch, PackedTree, pack

__all__ = [
    "ROLES",
    "Engine",
    "EngineConfigError",
    "Loss",
    "MicroBatchOutput",
    "MicroBatchRun",
    "StepStats",
    "TrainBatch",
    "check_role",
]

# actor: trained, log-probs; critic: trained, values; ref: frozen, log-probs.
ROLES = ("actor", "critic", "ref")


def with_dtype_resolved(source: ModelSource, device: torch.device) -> ModelSource:
    """``source`` with ``model.dtype: auto`` resolved for ``device``: bfloat16 on CUDA, float32
    on the CPU (:func:`treetrain.alloc.precision.resolve_dtype`); every engine builds from it."""
    dtype = resolve_dtype(source.settings.dtype, cuda=device.type == "cuda")
    if dtype == source.settings.dtype:
        return source
    return replace(source, settings=source.settings.model_copy(update={"dtype": dtype}))


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


class Engine(ABC):
    """Build from a model and a parallel strategy; train with or without tree packing.

    The core owns the lifecycle once: the constructor prologue, ``forward`` and
    ``forward_backward`` over micro-batches (stats through :class:`StatTotals`), ``step`` with
    one gradient norm, ``save`` / ``load`` (every RNG state, the torn-checkpoint error the
    trainer's fallback needs) and the local-rollout sampler. An engine supplies hooks: how to
    build its model, how one micro-batch (or a pipeline schedule of them) runs, which ranks
    hold copies of each gradient, and how its state reaches and leaves the disk."""

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
    precision: Precision  # the dtypes this engine computes in and keeps its weights in

    def __init__(
        self,
        model: ModelSettings | ModelSource,
        layout: ParallelLayout,
        tree: TreeTrainingSettings,
        optimizer: OptimizerSettings | None = None,
        *,
        role: str = "actor",
    ) -> None:
        """Everything every engine checks and sets before it builds its model: the role, the
        resolved model source, the tree settings, the engine's own layout checks
        (:meth:`_prepare`), the attention backend (a trained role needs one with a backward
        on this device: that fails here, not in the first step) and the packer's capacity;
        then the engine's model (:meth:`_build`) and optimizer (:meth:`_build_optimizer`)."""
        check_role(role)
        source = model if isinstance(model, ModelSource) else ModelSource.resolve(model)
        self.source = with_dtype_resolved(source, layout.device)
        self.settings = self.source.settings
        self.layout = layout
        self.precision = precision(self.engine_name, layout.allocation.dims, self.settings.dtype)
        self.tree = tree
        self.role = role
        self.block_size = tree.block_size
        self._prepare()
        self.attention = resolve(tree.attention, layout.device, needs_grad=optimizer is not None)
        self._pack_config(tree=True)  # the packer's message when max_tokens_per_mb does not fit
        self.optim = optimizer
        self.steps = 0
        self._sampler: torch.nn.Module | None = None
        self._build()
        self.optimizer = self._build_optimizer(optimizer)

    @staticmethod
    def init_layout(allocation: Allocation) -> ParallelLayout:
        """This engine's layout of ``allocation``: joins the process group (once per process)
        and builds the engine's meshes or groups; the factory calls it before the constructor."""
        return init_distributed(allocation)

    @property
    def engine_name(self) -> str:
        """The backend prefix (the registry's name of this engine); written into checkpoints."""
        return self.layout.allocation.backend

    def _prepare(self) -> None:
        """Engine checks of the model against the layout, before anything is built."""
        return

    @abstractmethod
    def _build(self) -> None:
        """Build this rank's :attr:`model` (and what the engine derives from it)."""

    def _build_optimizer(self, settings: OptimizerSettings | None) -> torch.optim.Optimizer | None:
        """The optimizer, once :attr:`model` is built (None: forward only)."""
        return adamw(self.model, settings)

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

    def _averaged_over(self) -> int:
        """How many ranks' gradients the engine's backward averages (FSDP: its shard group);
        the loss is scaled up by as many, so the result is the batch's sum. 1: summed."""
        return 1

    def _after_backward(self) -> None:
        """Complete the gradients after the last micro-batch (sums over ranks)."""
        return

    def _last_stage(self) -> bool:
        """Whether this rank runs the model's head (sees the loss and the outputs)."""
        return True

    def _stat_group(self) -> Any:
        """The ranks (of one pipeline stage) whose loss parts add up to the batch's: data and
        context ranks (None: this process alone)."""
        return None

    def _pp_group(self) -> Any:
        """The pipeline group (None: one stage); figures go from the last stage to the others."""
        return None

    def _cp_group(self) -> Any:
        """The context-parallel group (each position's output is on one of its ranks)."""
        return None

    def _owns_outputs(self) -> bool:
        """Whether this rank's forward outputs are sent to the others (one holder suffices)."""
        return self._last_stage()

    # -- forward_backward and forward ------------------------------------------------------
    def forward_backward(self, batch: TrainBatch, loss: Loss, *, tree: bool | None = None) -> StepStats:
        """Accumulate gradients of ``loss`` over ``batch``; ``tree`` overrides the config.

        One global token count, fixed before the micro-batch loop (every rank holds the whole
        batch), divides every micro-batch's loss sum, so uneven micro-batches and ranks still
        give the gradient of the batch mean."""
        if self.optimizer is None:
            raise RuntimeError(f"the {self.role} engine was built without an optimizer: it cannot train")
        self.model.train()
        packed = self.pack(batch.sequences, tree=tree)
        total = max(batch.num_loss_tokens(), 1)
        scale = self._averaged_over() / total
        device = self.layout.device
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

        host = totals.reduce(total, self._stat_group()) if self._last_stage() else {}
        pp = self._pp_group()
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

        def collect(i: int, run: MicroBatchRun) -> None:
            part = run.out.values if self.role == "critic" else run.out.logprobs
            assert part is not None
            flat = part.float()
            if run.sel_M is not None:  # context ranks: each holds some positions; add them up
                flat = torch.zeros(run.sel_M.shape[0], device=part.device).masked_scatter_(run.sel_M, flat)
                if self.layout.cp > 1:
                    dist.all_reduce(flat, group=self._cp_group())
            mine.update(unpack_sequence_tensors(run.tree, flat.cpu(), lengths))

        self._schedule(self._micro_batches(packed), collect, entropy=False, train=False)
        if self.layout.world_size > 1:  # every data rank's sequences to every rank, once
            every: list[Any] = [None] * self.layout.world_size
            dist.all_gather_object(every, mine if self._owns_outputs() else {})
            for part in every:
                mine.update(part)
        return [mine[i] for i in range(len(batch))]

    # -- the optimizer step ----------------------------------------------------------------
    def _grad_pieces(self) -> Iterable[tuple[torch.Tensor, int]]:
        """This rank's gradients and how many ranks of the world hold each same tensor."""
        return dtensor_pieces(self.model.parameters())

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients (one collective; every distinct tensor once)."""
        return global_norm(self._grad_pieces(), device=self.layout.device)

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

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, path: Path, extra: Mapping[str, Any]) -> None:
        """A resumable checkpoint: model, optimizer, step count, every RNG state and ``extra``
        (each engine's files: :meth:`_write`)."""
        path.mkdir(parents=True, exist_ok=True)
        meta = {
            "steps": self.steps,
            "rng": files.rng_state(),
            "extra": dict(extra),
            "model": self.settings.path,
            "engine": self.engine_name,
        }
        self._write(path, meta)

    def load(self, path: Path) -> dict[str, Any]:
        """Restore what :meth:`save` wrote; returns its ``extra``. A torn or empty checkpoint
        raises :class:`CheckpointUnreadableError` on every rank (the trainer then tries an
        older one); one of another model, engine or layout an ``EngineConfigError``."""
        meta = self._read(path)
        files.restore_rng(meta)
        self.steps = int(meta["steps"])
        self._refresh_sampler()
        extra: dict[str, Any] = dict(meta["extra"])
        return extra

    def _same_run(self, meta: Mapping[str, Any], path: Path) -> None:
        """Refuse a checkpoint of another model or engine, with the fix."""
        model = meta.get("model_path", meta.get("model", self.settings.path))  # Megatron: model_path
        engine = meta.get("engine", self.engine_name)  # older checkpoints name none
        if model != self.settings.path or engine != self.engine_name:
            raise EngineConfigError(
                f"checkpoint {path} was written for model {model!r} by the {engine} engine, but this run trains "
                f"{self.settings.path!r} with {self.engine_name}; fix: give this run a new checkpoint.dir "
                "(or restore the old settings)"
            )

    def _dcp_state(self) -> dict[str, Any]:
        """This rank's model (and optimizer) state for torch.distributed.checkpoint."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._optim_options())
        return {"model": model_sd, "optim": optim_sd}

    def _optim_options(self) -> Any:
        """``get_state_dict`` / ``set_state_dict`` options of the optimizer state (None: the defaults)."""
        return None

    def _write(self, path: Path, meta: dict[str, Any]) -> None:
        """DCP engines: every rank writes its shards (one process: ``torch.save``) and its own
        metadata file."""
        if self.layout.world_size > 1:
            from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

            dcp_save(self._dcp_state(), checkpoint_id=str(path / self.role))
        else:
            torch.save(self._dcp_state(), path / f"{self.role}.pt")  # one process: no collectives to plan
        torch.save(meta, path / f"{self.role}-rank{self.layout.rank}.pt")

    def _read(self, path: Path) -> dict[str, Any]:
        """DCP engines: load the state in place; returns this rank's checked metadata."""
        return files.load_sharded(
            path,
            self.role,
            self.layout.rank,
            self.layout.world_size,
            same_run=lambda meta: self._same_run(meta, path),
            model=self.model,
            optimizer=self.optimizer,
            empty=self._dcp_state,
            optim_options=self._optim_options(),
        )

    # -- Hugging Face weights and local rollout --------------------------------------------
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

    def _sampler_weights(self) -> Mapping[str, torch.Tensor] | None:
        """Full Hugging Face weights (on-disk names, one tensor per expert) on every rank, for
        the local-rollout sampler (a collective); None: :attr:`model` is the sampler itself."""
        return None

    def sampling_model(self) -> torch.nn.Module:
        """What local rollout samples from: a module called like a Hugging Face causal LM
        (attention masks, KV caches), kept up to date with the trained weights. Engines with
        their own models get a transformers model built from the config on first use (every
        rank: a collective) and refreshed in place after every step and load, so the rollout's
        KV-cache check (parameter versions) sees the change; otherwise :attr:`model` itself."""
        if self._sampler is None:
            weights = self._sampler_weights()
            if weights is None:
                return self.model
            from transformers import AutoModelForCausalLM

            auto: Any = AutoModelForCausalLM  # untyped
            dtype = getattr(torch, self.settings.dtype)
            model = auto.from_config(self.source.config, dtype=dtype).to(self.layout.device)
            self._sampler = model.eval().requires_grad_(False)
            _copy_hf(self._sampler, weights)
        return self._sampler

    def _refresh_sampler(self) -> None:
        """Bring :meth:`sampling_model` up to the new weights (after a step or a load)."""
        if self._sampler is not None:
            weights = self._sampler_weights()
            assert weights is not None
            _copy_hf(self._sampler, weights)


def _copy_hf(model: torch.nn.Module, hf: Mapping[str, torch.Tensor]) -> None:
    """Copy on-disk Hugging Face tensors into transformers' in-memory ones, which fuse a MoE
    layer's experts (``experts.gate_up_proj [E, 2f, h]`` from the per-expert gate and up,
    ``experts.down_proj [E, h, f]``)."""
    with torch.no_grad():
        for name, target in model.named_parameters():  # a tied head once
            if name in hf:
                target.copy_(hf[name])
                continue
            base, kind = name.rsplit(".", 1)
            count = target.shape[0]
            if kind == "gate_up_proj":
                gate = [hf[f"{base}.{e}.gate_proj.weight"] for e in range(count)]
                up = [hf[f"{base}.{e}.up_proj.weight"] for e in range(count)]
                target.copy_(torch.cat([torch.stack(gate), torch.stack(up)], dim=1))
            elif kind == "down_proj":
                target.copy_(torch.stack([hf[f"{base}.{e}.down_proj.weight"] for e in range(count)]))
            else:
                raise KeyError(f"no Hugging Face weights for {name}")


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
