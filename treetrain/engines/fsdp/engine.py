"""The FSDP engine: a Hugging Face model (:mod:`.model`) spread over the ranks
(:mod:`.parallelize`), trained with tree packing through transformers' attention registry.

Letters: N packed tokens of one micro-batch, V vocabulary, M gathered positions.

Every rank holds the whole batch (rollouts are broadcast) and packs it the same way; the
packer balances trees so that every data-parallel rank runs the same number of micro-batches
(FSDP's collectives need that), and tensor-parallel ranks of one data-parallel rank run the
same trees.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from treetrain.attention import TreeAttentionMeta, resolve, tree_forward
from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
from treetrain.engines import checkpoint_files as files
from treetrain.engines.base import (
    LOSS_STAT,
    Engine,
    Loss,
    MicroBatchOutput,
    StatTotals,
    StepStats,
    TrainBatch,
    adamw,
    check_role,
)
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.fsdp.model import build_parallel
from treetrain.engines.grads import grad_norm
from treetrain.engines.parallel import ParallelLayout
from treetrain.engines.source import ModelSource
from treetrain.logprob import TreeTensors, gather_logprobs, pack_sequence_tensors, unpack_sequence_tensors
from treetrain.tree import PackedTree


@dataclass(slots=True)
class _Run:
    tensors: TreeTensors
    out: MicroBatchOutput
    anchor: torch.Tensor  # a scalar that touches every output (backward on empty trees)


class FSDPEngine(Engine):
    """Actor (log-probs), critic (values) or reference (log-probs, frozen) on a Hugging Face
    model. ``optimizer=None``: forward only (the parameters do not require grad)."""

    def __init__(
        self,
        model: ModelSettings | ModelSource,
        layout: ParallelLayout,
        tree: TreeTrainingSettings,
        optimizer: OptimizerSettings | None = None,
        *,
        role: str = "actor",
    ) -> None:
        check_role(role)
        self.source = model if isinstance(model, ModelSource) else ModelSource.resolve(model)
        self.settings = self.source.settings
        self.layout = layout
        self.tree = tree
        self.role = role
        self.block_size = tree.block_size
        # Trained roles need a backward: a backend that has none on this device fails here,
        # not inside the first step.
        self.attention = resolve(tree.attention, layout.device, needs_grad=optimizer is not None)
        # Fails early with the packer's message when max_tokens_per_mb does not fit the alignment.
        self._pack_config(tree=True)
        self.model: nn.Module = build_parallel(self.source, role, layout)
        self.optim = optimizer
        self.optimizer = adamw(self.model, optimizer)
        self.steps = 0

    @property
    def vocab_size(self) -> int:
        return int(self.source.config.vocab_size)

    # -- one micro-batch -------------------------------------------------------------------
    def _run(self, tree: PackedTree, *, entropy: bool) -> _Run:
        device = self.layout.device
        tensors = TreeTensors.from_tree(tree, device)
        meta = TreeAttentionMeta.from_tree(tree, backend=self.attention, block_size=self.block_size, device=device)
        with tree_forward():
            raw = self.model(
                input_ids=tensors.input_ids_N[None],
                position_ids=tensors.position_ids_N[None],
                use_cache=False,
                tree_attention=meta,
            )
        if self.role == "critic":
            values_N = raw[0]
            out = MicroBatchOutput(values=values_N[tensors.pred_M].float())
            anchor = values_N.sum() * 0.0
        else:
            logits = raw.logits
            logits_NV = logits.view(logits.shape[-2], logits.shape[-1])  # a view: no select-backward copy
            logp_M, ent_M = gather_logprobs(logits_NV, tensors.pred_M, tensors.label_M, with_entropy=entropy)
            out = MicroBatchOutput(logprobs=logp_M, entropy=ent_M)
            anchor = logits_NV[:1, :1].sum() * 0.0
        return _Run(tensors=tensors, out=out, anchor=anchor)

    def forward_backward(self, batch: TrainBatch, loss: Loss, *, tree: bool | None = None) -> StepStats:
        if self.optimizer is None:
            raise RuntimeError(f"the {self.role} engine was built without an optimizer: it cannot train")
        self.model.train()
        packed = self.pack(batch.sequences, tree=tree)
        # The global token count, fixed before the micro-batch loop: every rank holds the whole
        # batch, so no all-reduce is needed. Each micro-batch divides its sum by it, so uneven
        # micro-batches (and ranks) still give the mean over the batch.
        total = max(batch.num_loss_tokens(), 1)
        # FSDP averages gradients over the dp ranks; each rank's loss is its share of one sum.
        scale = self.layout.dp / total
        device = self.layout.device
        totals = StatTotals(device)
        trees = packed.rank_trees(self.layout.dp_rank)
        for tree_mb in trees:
            run = self._run(tree_mb, entropy=loss.needs_entropy)
            mask_M = pack_sequence_tensors(tree_mb, batch.loss_mask).to(device)
            inputs = {k: pack_sequence_tensors(tree_mb, v).to(device) for k, v in batch.tensors.items()}
            mb_loss, stats = loss(run.out, mask_M, inputs)
            torch.autograd.backward((mb_loss + run.anchor) * scale)
            totals.add({LOSS_STAT: mb_loss, **stats})
        group = self.layout.mesh["dp"].get_group() if self.layout.dp > 1 and self.layout.mesh is not None else None
        host = totals.reduce(total, group)
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

    @torch.no_grad()
    def forward(self, batch: Sequence[Sequence[int]], *, tree: bool | None = None) -> list[torch.Tensor]:
        """Per-sequence log-probs (actor, ref) or values (critic), fp32, ``len - 1`` each, on
        the CPU, in input order."""
        if not batch:
            return []
        self.model.eval()
        packed = self.pack(batch, tree=tree)
        lengths = [len(s) - 1 for s in batch]
        mine: dict[int, torch.Tensor] = {}
        for tree_mb in packed.rank_trees(self.layout.dp_rank):
            run = self._run(tree_mb, entropy=False)
            flat = run.out.values if self.role == "critic" else run.out.logprobs
            assert flat is not None
            mine.update(unpack_sequence_tensors(tree_mb, flat.float().cpu(), lengths))
        if self.layout.dp > 1:
            assert self.layout.mesh is not None
            gathered: list[Any] = [None] * self.layout.dp
            dist.all_gather_object(gathered, mine, group=self.layout.mesh["dp"].get_group())
            for part in gathered:
                mine.update(part)
        return [mine[i] for i in range(len(batch))]

    # -- optimizer -------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        return grad_norm(self.model.parameters(), device=self.layout.device)

    # -- checkpoints -----------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, path: Path, extra: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        path.mkdir(parents=True, exist_ok=True)
        if self.layout.world_size > 1:
            dcp_save(self._state(), checkpoint_id=str(path / self.role))  # each rank writes its shards
        else:
            torch.save(self._state(), path / f"{self.role}.pt")  # one process: no collectives to plan
        rng = {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        meta = {"steps": self.steps, "rng": rng, "extra": dict(extra), "model": self.settings.path}
        torch.save(meta, path / f"{self.role}-rank{self.layout.rank}.pt")

    def load(self, path: Path) -> dict[str, Any]:
        def same_run(meta: Mapping[str, Any]) -> None:
            saved_model = meta.get("model", self.settings.path)  # older checkpoints lack it
            if saved_model != self.settings.path:
                raise EngineConfigError(
                    f"checkpoint {path} was written for model {saved_model!r}, but this run trains "
                    f"{self.settings.path!r}; fix: give this run a new checkpoint.dir (or set model.path back)"
                )

        meta = files.load_sharded(
            path,
            self.role,
            self.layout.rank,
            self.layout.world_size,
            same_run=same_run,
            model=self.model,
            optimizer=self.optimizer,
            empty=self._state,
        )
        self.steps = int(meta["steps"])
        extra: dict[str, Any] = meta["extra"]
        return extra

    def export_hf(self, path: Path) -> None:
        """Full (unsharded) weights as safetensors + config; rank 0 writes, every rank joins."""
        state = self.hf_weights()
        if state is not None:
            path.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(str(path), state_dict=state)  # type: ignore[operator]
        if self.layout.world_size > 1:
            dist.barrier()

    def hf_weights(self) -> dict[str, torch.Tensor] | None:
        """Full (unsharded) weights by Hugging Face name, gathered to rank 0's CPU; every rank joins."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.role == "critic":
            raise EngineConfigError("only an actor exports Hugging Face weights for rollout servers")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)} if self.layout.is_main else None

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients by parameter name (tests and parity scripts)."""
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().cpu().clone()
        return out
