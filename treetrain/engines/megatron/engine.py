"""The Megatron engine: a megatron-core ``GPTModel`` (:mod:`.model`) over Megatron's parallel
state (:mod:`.parallel`), trained on packed trees with our own pipeline schedule.

Letters: N tree tokens (a context-parallel rank holds N / c of them), M gathered positions, h
hidden size.

Every rank holds the whole batch and packs it the same way, so every rank knows the size of
every micro-batch: pipeline stages exchange exactly those shapes (trees of different sizes
in one step need no padding to the largest). Data-parallel ranks run their own trees;
tensor- and context-parallel ranks of one data-parallel rank run the same trees (a context
parallel rank its contiguous chunk of each tree's rows).

Loss scaling: every micro-batch's loss sum is divided by the batch's trained-token count,
fixed before the micro-batch loop; gradients are then summed (not averaged) over the data x
context parallel ranks, so the result is the gradient of the batch mean however the trees
fall on ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from treetrain.attention import TreeAttentionMeta
from treetrain.config import OptimizerSettings
from treetrain.engines import checkpoint_files as files
from treetrain.engines.base import Engine
from treetrain.engines.contract import MicroBatchOutput, MicroBatchRun, OnRun
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.hf_model import build_model
from treetrain.engines.lora import Adapter
from treetrain.engines.lora.linear import is_adapter
from treetrain.engines.megatron import convert
from treetrain.engines.megatron import lora as megatron_lora
from treetrain.engines.megatron.grads import GradPlan, build_optimizer, finalize_grads, grad_norm, is_expert
from treetrain.engines.megatron.logprob import vocab_parallel_logprobs
from treetrain.engines.megatron.model import TreeGPT, TreeInput, transformer_engine_available
from treetrain.engines.megatron.parallel import MegatronLayout, init_megatron
from treetrain.engines.megatron.schedule import run_schedule
from treetrain.engines.precision import torch_dtype
from treetrain.engines.source import SafetensorsFiles
from treetrain.engines.zero import ShardedAdamW
from treetrain.logprob import TreeTensors
from treetrain.tree import PackedBatch, PackedTree, pad_tree


@dataclass(slots=True)
class _Chunk:
    """This rank's part of one tree: its rows, the gathered positions whose row it holds
    (``sel_M`` over the tree's M positions) and their local row and label."""

    tree: PackedTree
    input_ids_N: torch.Tensor
    tree_input: TreeInput
    sel_M: torch.Tensor  # bool [M]
    pred_m: torch.Tensor  # local rows of the selected positions
    label_m: torch.Tensor
    num_positions: int  # M


class MegatronEngine(Engine):
    """Actor (log-probs), critic (values) or reference (frozen) on megatron-core."""

    layout: MegatronLayout
    init_layout = staticmethod(init_megatron)
    model: TreeGPT

    def _build(self) -> None:
        hf, role, layout = self.source.config, self.role, self.layout
        self.model = TreeGPT(
            hf,
            role=role,
            recompute=self.settings.gradient_checkpointing,
            seed=self.settings.seed,
            # LoRA adapts the local spec's linears (TransformerEngine's fuse the norm into them).
            te=layout.device.type == "cuda" and transformer_engine_available() and self.lora is None,
        )
        self.tied = bool(getattr(hf, "tie_word_embeddings", False)) and role != "critic"
        self.shape = convert.shape_of(hf, layout)
        self._load_weights()
        if self.precision.params != "float32":
            # The precision rule (treetrain/alloc/precision.py): bf16 weights and gradients
            # (half the bytes); a trained engine steps fp32 master weights in its sharded
            # optimizer (:func:`.grads.build_optimizer`). Buffers (RoPE frequencies) stay fp32.
            # float16 keeps fp32 weights under autocast (no loss scaler).
            for p in self.model.parameters():
                p.data = p.data.to(torch_dtype(self.precision.params))
        self.model.to(layout.device)
        self.first, self.last = self.model.pre_process, self.model.post_process
        self.hidden_size = int(hf.hidden_size)
        self.autocast = torch_dtype(self.precision.compute) if self.precision.compute != "float32" else None
        if self.lora is not None:  # fp32 adapters over the frozen base (the core loads their values)
            megatron_lora.apply_lora(self.model.gpt, self.lora, self.lora_targets, self.shape, hf)

    # -- LoRA (treetrain/engines/lora/core.py; names: .lora, :mod:`.lora`) ---------------------
    def _lora_modules(self) -> dict[str, tuple[int, int]]:
        return megatron_lora.hf_modules(self.source.config, self.lora_targets, self.shape)

    def _lora_full(self, *, everywhere: bool, grads: bool = False) -> Adapter | None:
        if grads and isinstance(self.optimizer, ShardedAdamW):  # each rank holds only its summed shard
            self.optimizer.gather_grads()
        dense = self.layout.dp_rank == 0 and self.layout.cp_rank == 0
        mine = megatron_lora.pieces(self.model.gpt, self._layer_offset(), self.shape, dense=dense, grads=grads)
        every = self._gather(mine, everywhere=everywhere)
        if every is None:
            return None
        full = convert.assemble(every)
        return {m: (full[f"{m}.lora_A"], full[f"{m}.lora_B"]) for m in self._lora_modules()}

    def _lora_set(self, adapter: Adapter) -> None:
        megatron_lora.load(self.model.gpt, adapter, self._layer_offset(), self.shape)

    def _gather(self, pieces: list[convert.Piece], *, everywhere: bool) -> list[convert.Piece] | None:
        """Every rank's pieces on every rank (``everywhere``) or on rank 0 (None elsewhere)."""
        if self.layout.world_size == 1:
            return pieces
        every: list[Any] = [None] * self.layout.world_size
        if everywhere:
            dist.all_gather_object(every, pieces)
        else:
            dist.gather_object(pieces, every if self.layout.is_main else None, dst=0)
            if not self.layout.is_main:
                return None
        return [piece for part in every for piece in part]

    # -- weights ----------------------------------------------------------------------------
    def _layer_offset(self) -> int:
        layers = self.model.gpt.decoder.layers
        return int(layers[0].layer_number) - 1 if len(layers) else 0

    def _load_weights(self) -> None:
        """Each rank reads its own slices (a directory's safetensors; a random built-in model
        is built whole on every rank, it is tiny)."""
        read: Any
        if self.source.directory is not None:
            read = SafetensorsFiles(self.source.directory)
        else:
            read = convert.StateDictReader(build_model(self.source, "actor", dtype=torch.float32).state_dict())
        offset = self._layer_offset()
        with torch.no_grad():
            for name, p in self.model.gpt.named_parameters():
                if name.startswith("output_layer.") and self.role == "critic":
                    continue  # the value head keeps its seeded initialisation
                value = convert.load_tensor(name, offset, read, self.shape, tied=self.tied)
                if value.shape != p.shape:
                    raise EngineConfigError(
                        f"{name}: the checkpoint gives {tuple(value.shape)}, the model needs {tuple(p.shape)}"
                    )
                p.copy_(value)

    # -- packing ----------------------------------------------------------------------------
    def _micro_batches(self, packed: PackedBatch) -> list[PackedTree]:
        """This data-parallel rank's trees. Under expert parallel, tokens of the same
        micro-batch of every data-parallel rank meet in the expert layers (the allgather
        dispatcher needs equal sizes): each micro-batch is padded to its largest over the ranks."""
        layout = self.layout
        mine = packed.rank_trees(layout.dp_rank)
        if layout.ep * layout.etp == 1:
            return mine
        every = [packed.rank_trees(r) for r in range(layout.dp)]
        return [pad_tree(t, max(trees[i].padded_len for trees in every)) for i, t in enumerate(mine)]

    def _chunk(self, tree: PackedTree) -> _Chunk:
        device = self.layout.device
        t = TreeTensors.from_tree(tree, device)
        meta = TreeAttentionMeta.from_tree(tree, backend=self.attention, block_size=self.block_size, device=device)
        cp, n = self.layout.cp, tree.padded_len
        rows = n // cp
        r0 = self.layout.cp_rank * rows
        sel_M = (t.pred_M >= r0) & (t.pred_M < r0 + rows)
        return _Chunk(
            tree=tree,
            input_ids_N=t.input_ids_N[r0 : r0 + rows],
            tree_input=TreeInput(
                meta=meta,
                positions_N=t.position_ids_N[r0 : r0 + rows],
                padding_N=torch.arange(r0, r0 + rows, device=device) >= tree.num_tokens,
                row_start=r0,
            ),
            sel_M=sel_M,
            pred_m=t.pred_M[sel_M] - r0,
            label_m=t.label_M[sel_M],
            num_positions=int(t.pred_M.shape[0]),
        )

    # -- one stage, one micro-batch ----------------------------------------------------------
    def _stage(self, chunk: _Chunk, hidden: torch.Tensor | None) -> torch.Tensor:
        self.model.set_input_tensor(hidden)
        ids = chunk.input_ids_N if self.first else None
        if self.autocast is None:
            out: torch.Tensor = self.model(ids, chunk.tree_input)
            return out
        with torch.autocast(self.layout.device.type, dtype=self.autocast):
            out = self.model(ids, chunk.tree_input)
        return out

    def _outputs(self, chunk: _Chunk, out: torch.Tensor, *, entropy: bool) -> MicroBatchRun:
        """The last stage's per-position outputs (this rank's positions) and a zero that
        touches every output row (so that backward reaches every layer and collective even
        when this rank has no position)."""
        anchor = out.sum() * 0.0
        if self.role == "critic":
            return MicroBatchRun(chunk.tree, MicroBatchOutput(values=out[chunk.pred_m].float()), anchor, chunk.sel_M)
        vocab = out.shape[-1]
        logp, ent = vocab_parallel_logprobs(
            out,
            chunk.pred_m,
            chunk.label_m,
            vocab_start=self.layout.tp_rank * vocab,
            group=self.layout.group("tp"),
            with_entropy=entropy,
        )
        return MicroBatchRun(chunk.tree, MicroBatchOutput(logprobs=logp, entropy=ent), anchor, chunk.sel_M)

    # -- the schedule -----------------------------------------------------------------------
    def _p2p_shape(self, chunk: _Chunk) -> tuple[int, int, int]:
        """Hidden states between stages: this context rank's rows, split over the tensor
        ranks by sequence parallel."""
        rows = chunk.tree.padded_len // (self.layout.cp * self.layout.tp)
        return (rows, 1, self.hidden_size)

    def _schedule(self, trees: Sequence[PackedTree], on_run: OnRun, *, entropy: bool, train: bool) -> None:
        """Every micro-batch through this rank's stage (:func:`.schedule.run_schedule`);
        ``on_run`` runs on the last stage. Activations cross stages in fp32 (exact, and every
        stage knows the dtype)."""
        chunks = [self._chunk(t) for t in trees]

        def on_output(i: int, out: torch.Tensor) -> torch.Tensor | None:
            return on_run(i, self._outputs(chunks[i], out, entropy=entropy))

        run_schedule(
            lambda i, hidden: self._stage(chunks[i], hidden),
            [self._p2p_shape(c) for c in chunks],
            on_output,
            stages=self.layout.pp,
            first=self.first,
            last=self.last,
            device=self.layout.device,
            train=train,
            schedule=self.settings.pipeline_schedule,
        )

    # -- the core's hooks ------------------------------------------------------------------
    def _after_backward(self) -> None:
        self._finalize_grads()

    # -- gradients and the optimizer ---------------------------------------------------------
    def _grad_plan(self) -> GradPlan:
        return GradPlan(self.layout, tied=self.tied)

    def _build_optimizer(self, settings: OptimizerSettings | None) -> torch.optim.Optimizer | None:
        """AdamW sharded over the data ranks (ZeRO-1, :func:`.grads.build_optimizer`)."""
        trained = [(n, p) for n, p in self.model.gpt.named_parameters() if p.requires_grad or settings is None]
        return build_optimizer(self.model, trained, self._grad_plan(), settings)

    def _finalize_grads(self) -> None:
        sharded = self.optimizer if isinstance(self.optimizer, ShardedAdamW) else None
        finalize_grads(self.model.gpt.named_parameters(), self._grad_plan(), sharded)

    def grad_norm(self) -> torch.Tensor:
        if isinstance(self.optimizer, ShardedAdamW):  # the summed shards, each element once
            return self.optimizer.grad_norm(self.layout.device)
        return grad_norm(self.model.gpt.named_parameters(), self._grad_plan(), device=self.layout.device)

    # -- checkpoints and export --------------------------------------------------------------
    def _own_file(self, path: Path) -> Path:
        return path / f"{self.role}-megatron-rank{self.layout.rank}.pt"

    def _write(self, path: Path, meta: dict[str, Any]) -> None:
        """Each rank writes one file: its shards, optimizer state, RNG and the core's metadata
        (resume needs the same backend string; :meth:`export_hf` is the layout-free copy)."""
        state = {
            **meta,
            "model_path": meta["model"],  # "model" holds the weights here
            "layout": str(self.layout.allocation),
            # LoRA: the adapter alone (the frozen base is the model's own files).
            "model": {k: v for k, v in self.model.state_dict().items() if self.lora is None or is_adapter(k)},
            "optim": self.optimizer.state_dict() if self.optimizer is not None else None,
        }
        torch.save(state, self._own_file(path))
        if self.layout.world_size > 1:
            dist.barrier()

    def _read(self, path: Path) -> dict[str, Any]:
        problem: Exception | None = None
        state: dict[str, Any] = {}
        try:  # this rank's own file; every rank learns of a problem before the sampler's collective
            own = files.own_file(path, self._own_file(path).name, "another layout or engine")
            state = files.read(own, map_location=self.layout.device)
            self._same_run(state, path)
            if state.get("layout") != str(self.layout.allocation):
                raise EngineConfigError(
                    f"checkpoint {path} was written on {state.get('layout')!r}, but this run trains on "
                    f"{str(self.layout.allocation)!r}; fix: give this run a new checkpoint.dir (or restore the backend)"
                )
            files.check_meta(state, own)
            files.check_state(state, own, optimizer=self.optimizer is not None)
            try:
                self._load_model_state(state["model"])
                if self.optimizer is not None:
                    self.optimizer.load_state_dict(state["optim"])
            except (RuntimeError, KeyError, ValueError) as err:
                raise files.cannot_resume(self.role, path, err) from None
        except (EngineConfigError, FileNotFoundError) as err:  # CheckpointUnreadableError included
            problem = err
        files.agree(problem, self.layout.world_size)
        return state

    def _load_model_state(self, saved: dict[str, Any]) -> None:
        if self.lora is None:
            self.model.load_state_dict(saved)
            return
        want = {k for k in self.model.state_dict() if is_adapter(k)}
        if set(saved) != want:
            raise KeyError(f"the checkpoint's adapter has {len(saved)} tensors, this run's {len(want)}")
        self.model.load_state_dict(saved, strict=False)

    def _pieces(self, *, grads: bool = False) -> list[convert.Piece]:
        """This rank's Hugging Face pieces of the weights (one copy over data x context ranks)."""
        offset = self._layer_offset()
        dense = self.layout.dp_rank == 0 and self.layout.cp_rank == 0
        pieces: list[convert.Piece] = []
        for name, p in self.model.gpt.named_parameters():
            if (dense or is_expert(name)) and not is_adapter(name):
                pieces += convert.export_pieces(name, p, offset, self.shape, tied=self.tied)
        return pieces

    def _full_state(self) -> dict[str, torch.Tensor]:
        """Full Hugging Face weights on every rank (a collective; LoRA: merged, W + s B A)."""
        every = self._gather(self._pieces(), everywhere=True)
        assert every is not None
        merged = self._merged(convert.assemble(every), everywhere=True)
        assert merged is not None
        return merged

    def _sampler_weights(self) -> dict[str, torch.Tensor]:
        return self._full_state()

    def export_hf(self, path: Path) -> None:
        """Full Hugging Face weights (safetensors + config): every rank's pieces go to rank 0,
        which puts them together and writes; every rank joins."""
        if self.role == "critic":
            raise EngineConfigError("only an actor exports Hugging Face weights for rollout servers")
        every = self._gather(self._pieces(), everywhere=False)
        state = self._merged(convert.assemble(every) if every is not None else None)  # LoRA: W + s B A
        if state is not None:
            from safetensors.torch import save_file

            path.mkdir(parents=True, exist_ok=True)
            save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
            self.source.config.save_pretrained(str(path))
        if self.layout.world_size > 1:
            dist.barrier()

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Hugging Face-named full gradients, put together on every rank (tests)."""
        if isinstance(self.optimizer, ShardedAdamW):  # each rank holds only its summed shard
            self.optimizer.gather_grads()
        offset = self._layer_offset()
        dense = self.layout.dp_rank == 0 and self.layout.cp_rank == 0
        pieces: list[convert.Piece] = []
        for name, p in self.model.gpt.named_parameters():
            if p.grad is not None and (dense or is_expert(name)) and not is_adapter(name):
                if name.startswith("output_layer.") and self.role == "critic":
                    pieces.append(("value_head." + name.split(".")[-1], 0, 0, 1, p.grad.detach().cpu().clone()))
                    continue
                # A tied head's gradient was summed into the first stage's embedding (pp > 1).
                pieces += convert.export_pieces(name, p.grad, offset, self.shape, tied=self.tied)
        every: list[Any] = [pieces]
        if self.layout.world_size > 1:
            every = [None] * self.layout.world_size
            dist.all_gather_object(every, pieces)
        return convert.assemble([piece for part in every for piece in part])
