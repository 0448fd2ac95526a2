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
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from treetrain.attention import TreeAttentionMeta, resolve
from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
from treetrain.engines import checkpoint_files as files
from treetrain.engines.archon.layout import ArchonLayout
from treetrain.engines.archon.model import ModelArgs, Transformer
from treetrain.engines.archon.model.hf import from_hf, from_hf_state, to_hf
from treetrain.engines.archon.model.model import rope_inv_freq
from treetrain.engines.archon.parallelize import check_ep, check_tp, parallelize
from treetrain.engines.archon.pipeline import (
    StageShapes,
    exchange_tied_grad,
    keep_stage,
    pad_tree,
    run_schedule,
    stage_layers,
)
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
from treetrain.engines.grads import grad_norm
from treetrain.engines.source import ModelSource, SafetensorsFiles
from treetrain.logprob import TreeTensors, gather_logprobs, pack_sequence_tensors, unpack_sequence_tensors
from treetrain.tree import PackedTree


@dataclass(slots=True)
class _Inputs:
    """One micro-batch's model inputs on this rank: token ids (first stage) and the keyword
    arguments every stage reads, plus the gather indices of its log-probs."""

    tokens_n: torch.Tensor
    kwargs: dict[str, Any]  # positions_N, tree, valid_N (this context rank's rows)
    pred_M: torch.Tensor
    label_M: torch.Tensor
    mine_M: torch.Tensor | None


@dataclass(slots=True)
class _Run:
    out: MicroBatchOutput
    mine_M: torch.Tensor | None  # the positions this context rank gathered (None: all)
    anchor: torch.Tensor  # a scalar that touches every output (backward on empty trees)
    aux: torch.Tensor | None  # the MoE load-balancing loss, already weighted


class ArchonEngine(Engine):
    """Actor (log-probs), critic (tree-packed values) or reference (frozen log-probs).
    ``optimizer=None``: forward only."""

    layout: ArchonLayout

    def __init__(
        self,
        model: ModelSettings | ModelSource,
        layout: ArchonLayout,
        tree: TreeTrainingSettings,
        optimizer: OptimizerSettings | None = None,
        *,
        role: str = "actor",
    ) -> None:
        check_role(role)
        self.source = model if isinstance(model, ModelSource) else ModelSource.resolve(model)
        self.settings = self.source.settings
        self.args = ModelArgs.from_hf(self.source.config)
        self.layout = layout
        self.tree = tree
        self.role = role
        self.block_size = tree.block_size
        _check_layout(self.args, layout)
        self.attention = resolve(tree.attention, layout.device, needs_grad=optimizer is not None)
        self._pack_config(tree=True)  # the packer's message when max_tokens_per_mb does not fit
        self.compute_dtype: torch.dtype = getattr(torch, self.settings.dtype)
        # fp32 master weights where FSDP can cast for compute (data or context ranks > 1).
        sharded = layout.dp * layout.cp > 1
        self.param_dtype = torch.float32 if sharded and self.compute_dtype != torch.float32 else self.compute_dtype
        self.model: nn.Module = self._build()
        self.optim = optimizer
        self.optimizer = adamw(self.model, optimizer)
        self.steps = 0
        self._sampler: nn.Module | None = None

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def first_stage(self) -> bool:
        return self.layout.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.layout.pp_rank == self.layout.pp - 1

    def _split_tie(self) -> torch.Tensor | None:
        """This stage's copy of a tied embedding / head split over two stages (None: not split)."""
        if self.layout.pp == 1 or not self.args.tie_embeddings or self.role == "critic":
            return None
        m = self._transformer()
        if self.first_stage and m.tok_embeddings is not None:
            return m.tok_embeddings.weight
        if self.last_stage and m.output is not None:
            return m.output.weight
        return None

    # -- building --------------------------------------------------------------------------
    def _build(self) -> Transformer:
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
                keep_stage(model, split[layout.pp_rank], first=self.first_stage, last=self.last_stage)
            # Tied on one stage; across stages the two copies get summed gradients instead.
            if args.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
                model.output.weight = model.tok_embeddings.weight
        model.to(self.param_dtype)
        parallelize(
            model,
            layout,
            param_dtype=self.param_dtype,
            compute_dtype=self.compute_dtype,
            checkpointing=self.settings.gradient_checkpointing,
        )
        model.to_empty(device=layout.device)
        with torch.no_grad():
            model.get_buffer("inv_freq").copy_(rope_inv_freq(args))
        names = list(model.state_dict().keys())
        state: dict[str, Any] = {k: v.to(self.param_dtype) for k, v in self._hf_weights(names).items()}
        options = StateDictOptions(full_state_dict=True, strict=True)
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
            from treetrain.engines.fsdp.model import build_model

            hf = build_model(self.source, "actor", dtype=torch.float32).state_dict()
            state = from_hf_state(names, hf, n_experts=args.n_experts, tie_embeddings=args.tie_embeddings)
        if self.role == "critic":
            torch.manual_seed(self.settings.seed)  # the same head on every rank
            head = nn.Linear(args.dim, 1)
            state["value_head.weight"], state["value_head.bias"] = head.weight.detach(), head.bias.detach()
        return state

    # -- packing ---------------------------------------------------------------------------
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

    def _outputs(self, x: _Inputs, raw: torch.Tensor, *, entropy: bool) -> _Run:
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
        return _Run(out=out, mine_M=x.mine_M, anchor=anchor, aux=aux)

    def _run(self, tree: PackedTree, *, entropy: bool) -> _Run:
        x = self._inputs(tree)
        return self._outputs(x, self.model(x.tokens_n, **x.kwargs), entropy=entropy)

    def _pipeline(
        self,
        trees: Sequence[PackedTree],
        size: int,
        on_run: Callable[[PackedTree, _Run], torch.Tensor | None],
        *,
        entropy: bool,
        train: bool,
    ) -> None:
        """Every micro-batch through the pipeline stages, each tree padded to ``size`` (the
        step's largest: one shape per step). ``on_run`` runs on the last stage and returns the
        scalar to backward (``train``)."""
        if not trees:
            return
        padded = [pad_tree(t, size) for t in trees]
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
            scalar = on_run(padded[i], self._outputs(xs[i], raw, entropy=entropy))
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

    def _sum_group(self) -> dist.ProcessGroup | None:
        """Ranks whose loss parts add up to the batch's: data and context ranks."""
        if self.layout.mesh is None or self.layout.dp * self.layout.cp == 1:
            return None
        return self.layout.mesh["dp_cp"].get_group()

    def forward_backward(self, batch: TrainBatch, loss: Loss, *, tree: bool | None = None) -> StepStats:
        if self.optimizer is None:
            raise RuntimeError(f"the {self.role} engine was built without an optimizer: it cannot train")
        self.model.train()
        packed = self.pack(batch.sequences, tree=tree)
        # One global token count, fixed before the micro-batch loop (every rank holds the batch).
        total = max(batch.num_loss_tokens(), 1)
        # FSDP averages gradients over the data and context ranks: each rank's loss is its share
        # of one sum, scaled up by the number of ranks the average divides by.
        scale = self.layout.dp * self.layout.cp / total
        device = self.layout.device
        totals = StatTotals(device)
        trees = packed.rank_trees(self.layout.dp_rank)

        def scaled_loss(tree_mb: PackedTree, run: _Run) -> torch.Tensor:
            mask_M = pack_sequence_tensors(tree_mb, batch.loss_mask).to(device)
            inputs = {k: pack_sequence_tensors(tree_mb, v).to(device) for k, v in batch.tensors.items()}
            if run.mine_M is not None:
                mask_M = mask_M[run.mine_M]
                inputs = {k: v[run.mine_M] for k, v in inputs.items()}
            mb_loss, stats = loss(run.out, mask_M, inputs)
            totals.add({LOSS_STAT: mb_loss, **stats})
            extra = run.anchor if run.aux is None else run.anchor + run.aux * total / len(trees)
            return (mb_loss + extra) * scale

        if self.layout.pp > 1:
            # The schedule backwards each scalar as it is (scale_grads=False): scaled once, here.
            size = max(t.padded_len for t in packed.trees)
            self._pipeline(trees, size, scaled_loss, entropy=loss.needs_entropy, train=True)
            tied = self._split_tie()
            if tied is not None:
                exchange_tied_grad(tied, self.layout)
        else:
            for tree_mb in trees:
                torch.autograd.backward(scaled_loss(tree_mb, self._run(tree_mb, entropy=loss.needs_entropy)))
        host = totals.reduce(total, self._sum_group())
        if self.layout.pp > 1:  # only the last stage saw the loss
            got: list[Any] = [host]
            dist.broadcast_object_list(got, group=self.layout.group("pp"), group_src=self.layout.pp - 1)
            host = got[0]
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
        the CPU, in input order, on every rank."""
        if not batch:
            return []
        self.model.eval()
        packed = self.pack(batch, tree=tree)
        lengths = [len(s) - 1 for s in batch]
        mine: dict[int, torch.Tensor] = {}

        def collect(tree_mb: PackedTree, run: _Run) -> None:
            part = run.out.values if self.role == "critic" else run.out.logprobs
            assert part is not None
            flat = part.float()
            if run.mine_M is not None:  # context ranks: each holds some positions; add them up
                flat = torch.zeros(run.mine_M.shape[0], device=part.device).masked_scatter_(run.mine_M, flat)
                dist.all_reduce(flat, group=self.layout.group("cp"))
            mine.update(unpack_sequence_tensors(tree_mb, flat.cpu(), lengths))

        trees = packed.rank_trees(self.layout.dp_rank)
        if self.layout.pp > 1:
            self._pipeline(trees, max(t.padded_len for t in packed.trees), collect, entropy=False, train=False)
        else:
            for tree_mb in trees:
                collect(tree_mb, self._run(tree_mb, entropy=False))
        # Every data rank's sequences (pipeline: from the last stage) to every rank.
        pipelined = self.layout.pp > 1
        size = self.layout.world_size if pipelined else self.layout.dp
        if size > 1:
            gathered: list[Any] = [None] * size
            dist.all_gather_object(gathered, mine, group=None if pipelined else self.layout.group("dp"))
            for got in gathered:
                mine.update(got)
        return [mine[i] for i in range(len(batch))]

    # -- optimizer -------------------------------------------------------------------------
    def norm_params(self) -> list[torch.Tensor]:
        """The parameters the gradient norm counts: all, but a tied head split over two stages
        once (the last stage's copy holds the same summed gradient as the first's)."""
        tied = self._split_tie()
        skip = tied if tied is not None and not self.first_stage else None
        return [p for p in self.model.parameters() if p is not skip]

    def grad_norm(self) -> torch.Tensor:
        return grad_norm(self.norm_params(), stages=self.layout.pp, device=self.layout.device)

    # -- checkpoints -----------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_optim_keys())
        return {"model": model_sd, "optim": optim_sd}

    def save(self, path: Path, extra: Mapping[str, Any]) -> None:
        """DCP: every rank writes its own shards (one process: ``torch.save``)."""
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        path.mkdir(parents=True, exist_ok=True)
        if self.layout.world_size > 1:
            dcp_save(self._state(), checkpoint_id=str(path / self.role))
        else:
            torch.save(self._state(), path / f"{self.role}.pt")
        rng = {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        meta = {"steps": self.steps, "rng": rng, "extra": dict(extra), "model": self.settings.path, "engine": "archon"}
        torch.save(meta, path / f"{self.role}-rank{self.layout.rank}.pt")

    def load(self, path: Path) -> dict[str, Any]:
        def same_run(meta: Mapping[str, Any]) -> None:
            if meta.get("model", self.settings.path) != self.settings.path or meta.get("engine") != "archon":
                raise EngineConfigError(
                    f"checkpoint {path} was written for model {meta.get('model')!r} by the {meta.get('engine', 'fsdp')} "
                    f"engine, but this run trains {self.settings.path!r} with archon; fix: give this run a new checkpoint.dir"
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
            optim_options=_optim_keys(),
        )
        self.steps = int(meta["steps"])
        self._refresh_sampler()
        extra: dict[str, Any] = meta["extra"]
        return extra

    # -- Hugging Face weights ----------------------------------------------------------------
    def full_state(self) -> dict[str, torch.Tensor]:
        """Our full (unsharded) tensors of every pipeline stage on the CPU, on every rank (a
        collective per sharded tensor, one gather over the stages)."""
        out = {}
        for name, t in self.model.state_dict().items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            out[name] = full.detach().cpu()
        return self._merge_stages(out)

    def _merge_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.layout.pp == 1:
            return mine
        every: list[Any] = [None] * self.layout.pp
        dist.all_gather_object(every, mine, group=self.layout.group("pp"))
        merged: dict[str, torch.Tensor] = {}
        for part in every:
            merged.update(part)
        return merged

    def export_hf(self, path: Path) -> None:
        """Safetensors + config that transformers (and rollout servers) load; rank 0 writes,
        every rank joins the gathers."""
        from safetensors.torch import save_file

        if self.role == "critic":
            raise EngineConfigError("only an actor exports Hugging Face weights for rollout servers")
        state = to_hf(self.full_state(), tie_embeddings=self.args.tie_embeddings)
        if self.layout.is_main:
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
    def sampling_model(self) -> nn.Module:
        """A Hugging Face causal LM with this engine's weights, for local rollout (which calls
        a model like transformers' generate loop does: attention masks, KV caches). Built on
        first use on every rank (a collective: the full weights are gathered), refreshed in
        place after every optimizer step and checkpoint load, so the rollout's KV-cache check
        (parameter versions) sees the change."""
        if self._sampler is None:
            from transformers import AutoModelForCausalLM

            config = self.source.config
            auto: Any = AutoModelForCausalLM  # untyped
            model = auto.from_config(config, dtype=self.compute_dtype).to(self.layout.device)
            self._sampler = model.eval().requires_grad_(False)
            self._refresh_sampler()
        return self._sampler

    def _refresh_sampler(self) -> None:
        if self._sampler is None:
            return
        hf = to_hf(self.full_state(), tie_embeddings=False)
        with torch.no_grad():
            for name, p in self._sampler.state_dict().items():
                _copy_into(p, name, hf)


def _optim_keys() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Optimizer state and hyper-parameters keyed by parameter name: pipeline stages hold
    # different parameters, and a list of param groups per stage would collide in DCP.
    return StateDictOptions(flatten_optimizer_state_dict=True)


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def _copy_into(target: torch.Tensor, name: str, hf: Mapping[str, torch.Tensor]) -> None:
    """Copy the on-disk Hugging Face tensor(s) of ``name`` into transformers' in-memory one
    (which fuses a MoE layer's experts)."""
    if name in hf:
        target.copy_(hf[name])
    elif name.endswith("mlp.experts.gate_up_proj"):
        prefix = name.removesuffix("gate_up_proj")
        e = target.shape[0]
        gate = torch.stack([hf[f"{prefix}{i}.gate_proj.weight"] for i in range(e)])
        up = torch.stack([hf[f"{prefix}{i}.up_proj.weight"] for i in range(e)])
        target.copy_(torch.cat([gate, up], dim=1))
    elif name.endswith("mlp.experts.down_proj"):
        prefix = name.removesuffix("down_proj")
        target.copy_(torch.stack([hf[f"{prefix}{i}.down_proj.weight"] for i in range(target.shape[0])]))
    else:
        raise KeyError(f"no weights for {name}")


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
