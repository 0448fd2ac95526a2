"""The Archon engine: our own PyTorch-native models (:mod:`.model`) spread over the ranks by
:mod:`.parallelize`, trained on packed trees.

Letters: N padded tree tokens, n = N / c tokens on one context rank, V vocabulary, M
gathered positions of a micro-batch.

Every rank holds the whole batch and packs it the same way. Data-parallel ranks run their own
trees (the packer gives every one the same number); tensor-parallel ranks run the same trees
split by tokens between blocks; context-parallel ranks run the same trees, each its ``n``
consecutive rows, and gather only the log-probs whose predicting row they hold, so the loss
of a tree is the sum of its context ranks' parts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from treetrain.attention import TreeAttentionMeta
from treetrain.engines.archon.experts import check_ep
from treetrain.engines.archon.layout import ArchonLayout, init_layout
from treetrain.engines.archon.lora import EXPERT, from_adapter, hf_modules, to_adapter
from treetrain.engines.archon.model import ModelArgs, Transformer
from treetrain.engines.archon.model.hf import from_hf, from_hf_state, to_hf
from treetrain.engines.archon.model.model import rope_inv_freq
from treetrain.engines.archon.parallelize import check_tp, parallelize
from treetrain.engines.archon.pipeline import StageShapes, exchange_tied_grad, keep_stage, run_schedule, stage_layers
from treetrain.engines.base import Engine
from treetrain.engines.contract import MicroBatchOutput, MicroBatchRun, OnRun
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.grads import dtensor_pieces
from treetrain.engines.lora import Adapter
from treetrain.engines.lora.linear import is_adapter
from treetrain.engines.source import SafetensorsFiles
from treetrain.logprob import TreeTensors, gather_logprobs
from treetrain.tree import PackedBatch, PackedTree, pad_tree


@dataclass(slots=True)
class _Inputs:
    """One micro-batch's model inputs on this rank: token ids (first stage) and the keyword
    arguments every stage reads, plus the gather indices of its log-probs."""

    tokens_n: torch.Tensor
    kwargs: dict[str, Any]  # positions_N, tree, valid_N (this context rank's rows)
    pred_M: torch.Tensor
    label_M: torch.Tensor
    mine_M: torch.Tensor | None


class ArchonEngine(Engine):
    """Actor (log-probs), critic (tree-packed values) or reference (frozen log-probs).
    ``optimizer=None``: forward only."""

    layout: ArchonLayout
    init_layout = staticmethod(init_layout)

    def _build(self) -> None:
        # The precision rule (treetrain/alloc/precision.py): fp32 parameters on every layout,
        # FSDP2 casting them to a 16-bit compute dtype.
        self.compute_dtype: torch.dtype = getattr(torch, self.precision.compute)
        self.param_dtype: torch.dtype = getattr(torch, self.precision.params)
        self.model: nn.Module = self._build_model()

    def _prepare(self) -> None:
        self.args = ModelArgs.from_hf(self.source.config)
        _check_layout(self.args, self.layout)
        if self.args.is_moe and self.layout.etp > 1 and set(self.lora_targets) & set(EXPERT):
            raise EngineConfigError(
                f"actor.lora: adapters on experts split by an ffn t{self.layout.etp} are not built; fix: drop the "
                "ffn t, or target only q_proj, k_proj, v_proj, o_proj"
            )

    # -- LoRA (treetrain/engines/lora/core.py; names: .lora) -----------------------------------
    def _lora_modules(self) -> dict[str, tuple[int, int]]:
        return hf_modules(self.args, self.lora_targets)

    def _lora_full(self, *, everywhere: bool, grads: bool = False) -> Adapter | None:
        mine = {}
        for name, p in self.model.named_parameters():  # the same order on every rank of a stage
            if is_adapter(name):
                t = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p
                mine[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
        full = self._merge_stages(mine)
        return to_adapter(full) if everywhere or self.layout.is_main else None

    def _lora_set(self, adapter: Adapter) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import FSDPModule

        names = [n for n, _ in self.model.named_parameters() if is_adapter(n)]
        for unit in self.model.modules():  # the root stays gathered after a forward: shard it again first
            if isinstance(unit, FSDPModule):
                unit.reshard()
        state: dict[str, Any] = from_adapter(adapter, names)
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))

    def _split_tie(self) -> torch.Tensor | None:
        """This stage's copy of a tied embedding / head split over two stages (None: not split)."""
        if self.layout.pp == 1 or not self.args.tie_embeddings or self.role == "critic":
            return None
        m = self._transformer()
        if self.layout.first_stage and m.tok_embeddings is not None:
            return m.tok_embeddings.weight
        if self.layout.last_stage and m.output is not None:
            return m.output.weight
        return None

    # -- building --------------------------------------------------------------------------
    def _build_model(self) -> Transformer:
        """Build on the meta device, shard, allocate only this rank's shards, then load: every
        rank reads the checkpoint tensors it holds (memory-mapped safetensors)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        args, layout = self.args, self.layout
        with torch.device("meta"):
            model = Transformer(args, value_head=self.role == "critic")
            if layout.pp > 1:
                # Balanced by cost (attention at the largest tree, the head on the last stage).
                split = stage_layers(
                    args, layout.pp, tokens=self.tree.max_tokens_per_mb, value_head=self.role == "critic"
                )
                keep_stage(model, split[layout.pp_rank], first=layout.first_stage, last=layout.last_stage)
            # Tied on one stage; across stages the two copies get summed gradients instead.
            if args.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
                model.output.weight = model.tok_embeddings.weight
        model.to(self.param_dtype)
        lora = (self.lora, self.lora_targets) if self.lora is not None else None
        parallelize(model, layout, self.precision, checkpointing=self.settings.gradient_checkpointing, lora=lora)
        model.to_empty(device=layout.device)
        with torch.no_grad():
            model.get_buffer("inv_freq").copy_(rope_inv_freq(args))
        names = [n for n in model.state_dict() if not is_adapter(n)]  # the adapter: loaded by the core next
        state: dict[str, Any] = {k: v.to(self.param_dtype) for k, v in self._hf_weights(names).items()}
        options = StateDictOptions(full_state_dict=True, strict=lora is None)
        set_model_state_dict(model, state, options=options)
        return model

    def _hf_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        args = self.args
        if self.source.directory is not None:
            state = from_hf(
                names,
                SafetensorsFiles(self.source.directory),
                n_experts=args.n_experts,
                tie_embeddings=args.tie_embeddings,
            )
        else:
            # A random built-in model: transformers' own initialisation from the seed, so the
            # FSDP and Archon engines start from the same weights.
            from treetrain.engines.hf_model import build_model

            hf = build_model(self.source, "actor", dtype=torch.float32).state_dict()
            state = from_hf_state(names, hf, n_experts=args.n_experts, tie_embeddings=args.tie_embeddings)
        if self.role == "critic":
            torch.manual_seed(self.settings.seed)  # the same head on every rank
            head = nn.Linear(args.dim, 1)
            state["value_head.weight"], state["value_head.bias"] = head.weight.detach(), head.bias.detach()
        return state

    # -- one micro-batch -------------------------------------------------------------------
    def _inputs(self, tree: PackedTree) -> _Inputs:
        device = self.layout.device
        t = TreeTensors.from_tree(tree, device)
        meta = TreeAttentionMeta.from_tree(tree, backend=self.attention, block_size=self.block_size, device=device)
        big_n, c = tree.padded_len, self.layout.cp
        n = big_n // c
        r0 = self.layout.cp_rank * n
        valid_N = torch.arange(big_n, device=device) < tree.num_tokens
        pred_M, label_M, mine_M = t.pred_M, t.label_M, None
        if c > 1:
            mine_M = (pred_M >= r0) & (pred_M < r0 + n)
            pred_M, label_M = pred_M[mine_M] - r0, label_M[mine_M]
        kwargs = {"positions_N": t.position_ids_N[r0 : r0 + n], "tree": meta, "valid_N": valid_N[r0 : r0 + n]}
        return _Inputs(t.input_ids_N[r0 : r0 + n], kwargs, pred_M, label_M, mine_M)

    def _outputs(self, tree: PackedTree, x: _Inputs, raw: torch.Tensor, *, entropy: bool) -> MicroBatchRun:
        """Log-probs or values of the gathered positions from the head's output (last stage)."""
        if isinstance(raw, DTensor):
            raw = raw.to_local()  # a replicated value head under tensor parallel
        if self.role == "critic":
            out = MicroBatchOutput(values=raw[x.pred_M].float())
            anchor = raw.sum() * 0.0
        else:
            logp_M, ent_M = gather_logprobs(raw, x.pred_M, x.label_M, with_entropy=entropy)
            out = MicroBatchOutput(logprobs=logp_M, entropy=ent_M)
            anchor = raw[:1, :1].sum() * 0.0
        aux = None
        if self.args.use_aux_loss and self.model.training:
            found = self._transformer().moe_aux_loss()
            aux = None if found is None else found * self.args.router_aux_loss_coef
        return MicroBatchRun(tree=tree, out=out, anchor=anchor, sel_M=x.mine_M, aux=aux)

    def _run(self, tree: PackedTree, *, entropy: bool) -> MicroBatchRun:
        x = self._inputs(tree)
        return self._outputs(tree, x, self.model(x.tokens_n, **x.kwargs), entropy=entropy)

    def _micro_batches(self, packed: PackedBatch) -> list[PackedTree]:
        """This data rank's trees; under pipeline parallel each padded to the step's largest
        tree (pipelining needs one shape per step)."""
        mine = packed.rank_trees(self.layout.dp_rank)
        if self.layout.pp == 1 or not mine:
            return mine
        size = max(t.padded_len for t in packed.trees)
        return [pad_tree(t, size) for t in mine]

    def _schedule(self, trees: Sequence[PackedTree], on_run: OnRun, *, entropy: bool, train: bool) -> None:
        if self.layout.pp == 1:
            super()._schedule(trees, on_run, entropy=entropy, train=train)
        elif trees:
            self._pipeline(trees, on_run, entropy=entropy, train=train)

    def _pipeline(self, padded: Sequence[PackedTree], on_run: OnRun, *, entropy: bool, train: bool) -> None:
        """Every micro-batch through the pipeline stages (trees of one size). ``on_run`` runs
        on the last stage and returns the scalar to backward (``train``), already scaled."""
        size = padded[0].padded_len
        xs = [self._inputs(t) for t in padded]
        n = size // self.layout.cp
        d = self.args.dim
        shapes = StageShapes(
            tokens=(n,),
            hidden=(n // self.layout.tp, d),  # sequence parallel: a tensor rank's token shard
            output=(n,) if self.role == "critic" else (n, self.args.vocab_size),
            dtype=self.compute_dtype,
        )

        def on_output(i: int, raw: torch.Tensor) -> torch.Tensor:
            scalar = on_run(i, self._outputs(padded[i], xs[i], raw, entropy=entropy))
            return scalar if scalar is not None else torch.zeros((), device=raw.device)

        run_schedule(
            self.model,
            self.layout,
            shapes,
            [(x.tokens_n, x.kwargs) for x in xs],
            on_output,
            train=train,
            schedule=self.settings.pipeline_schedule,
        )

    def _transformer(self) -> Transformer:
        assert isinstance(self.model, Transformer)
        return self.model

    # -- the core's hooks ------------------------------------------------------------------
    def _after_backward(self) -> None:
        tied = self._split_tie()
        if tied is not None:  # both stages' copies get the summed gradient
            exchange_tied_grad(tied, self.layout)

    # -- optimizer -------------------------------------------------------------------------
    def norm_params(self) -> list[torch.Tensor]:
        """The parameters the gradient norm counts: all, but a tied head split over two stages
        once (the last stage's copy holds the same summed gradient as the first's)."""
        tied = self._split_tie()
        skip = tied if tied is not None and not self.layout.first_stage else None
        return [p for p in self.model.parameters() if p is not skip]

    def _grad_pieces(self) -> Iterator[tuple[torch.Tensor, int]]:
        return dtensor_pieces(self.norm_params(), holders=self.layout.world_size // self.layout.pp)

    def _optim_options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # Optimizer state and hyper-parameters keyed by parameter name: pipeline stages hold
        # different parameters, and a list of param groups per stage would collide in DCP. A
        # LoRA checkpoint holds the adapter only (the metadata's "lora" says whose).
        lora = self.lora is not None
        return StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=lora, strict=not lora)

    # -- Hugging Face weights ----------------------------------------------------------------
    def full_state(self) -> dict[str, torch.Tensor]:
        """Our full (unsharded) tensors of every pipeline stage on the CPU, on every rank (a
        collective per sharded tensor, one gather over the stages)."""
        out = {}
        for name, t in self.model.state_dict().items():
            if is_adapter(name):
                continue  # the adapter: _lora_full
            full = t.full_tensor() if isinstance(t, DTensor) else t
            out[name] = full.detach().cpu()
        return self._merge_stages(out)

    def _merge_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.layout.pp == 1:
            return mine
        every: list[Any] = [None] * self.layout.pp
        dist.all_gather_object(every, mine, group=self.layout.group_of("pp"))
        merged: dict[str, torch.Tensor] = {}
        for part in every:
            merged.update(part)
        return merged

    def export_hf(self, path: Path) -> None:
        """Safetensors + config that transformers (and rollout servers) load (with LoRA the
        merged weights); rank 0 writes, every rank joins the gathers."""
        from safetensors.torch import save_file

        if self.role == "critic":
            raise EngineConfigError("only an actor exports Hugging Face weights for rollout servers")
        state = self._merged(to_hf(self.full_state(), tie_embeddings=self.args.tie_embeddings))  # LoRA: W + s B A
        if state is not None:
            path.mkdir(parents=True, exist_ok=True)
            dtype = self.compute_dtype
            save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
            config = self.source.config.to_dict()
            config["torch_dtype"] = config["dtype"] = self.settings.dtype
            config.setdefault("architectures", [_ARCHITECTURES[self.args.family]])
            (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if self.layout.world_size > 1:
            dist.barrier()

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients by parameter name (tests and parity scripts)."""
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                out[name] = g.detach().cpu().clone()
        return self._merge_stages(out)

    # -- local rollout -----------------------------------------------------------------------
    def _sampler_weights(self) -> dict[str, torch.Tensor]:
        merged = self._merged(to_hf(self.full_state(), tie_embeddings=False), everywhere=True)
        assert merged is not None
        return merged


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def _check_layout(args: ModelArgs, layout: ArchonLayout) -> None:
    if layout.tp > 1:
        check_tp(args, layout.tp)
    if layout.pp > args.n_layers:
        raise EngineConfigError(
            f"p{layout.pp} needs at least {layout.pp} layers (one per stage); the model has {args.n_layers}; "
            f"fix: p <= {args.n_layers}"
        )
    if layout.pp > 1 and args.use_aux_loss:
        # Each stage's routers would add a loss term that the schedule cannot backward.
        raise EngineConfigError(
            f"p{layout.pp} with the MoE load-balancing loss (output_router_logits) is not built in the archon "
            "engine; fix: set output_router_logits=false or drop p"
        )
    if layout.ep * layout.etp > 1:
        check_ep(args, layout.allocation.dims)
