"""The FSDP engine: a Hugging Face model, FSDP2 (``fully_shard``) over the data-parallel
ranks, tensor parallel with DTensor when ``t > 1``, tree attention through transformers'
attention-function registry.

Letters: N packed tokens of one micro-batch, V vocabulary, M gathered positions.

Every rank holds the whole batch (rollouts are broadcast) and packs it the same way; the
packer balances trees so that every data-parallel rank runs the same number of micro-batches
(FSDP's collectives need that), and tensor-parallel ranks of one data-parallel rank run the
same trees.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from treetrain.attention import TreeAttentionMeta, block_size, resolve, tree_forward, use_tree_attention
from treetrain.engines import builtin
from treetrain.engines.base import (
    Engine,
    EngineConfigError,
    Loss,
    MicroBatchOutput,
    OptimConfig,
    StepStats,
    TrainBatch,
    TreeTrainingConfig,
)
from treetrain.engines.parallel import ParallelLayout
from treetrain.logprob import TreeTensors, gather_logprobs
from treetrain.tree import PackConfig, PackedBatch, PackedTree, pack

ROLES = ("actor", "critic", "ref")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which model: a Hugging Face directory (or hub name, if the machine can reach it) or
    ``builtin:NAME`` (see :mod:`treetrain.engines.builtin`)."""

    path: str
    seed: int = 0
    dtype: str = "float32"
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise EngineConfigError("model.path must be a model directory or builtin:NAME, e.g. builtin:smollm2-135m")
        builtin.check_path(self.path)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise EngineConfigError(f"model.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype


class ValueModel(nn.Module):
    """A critic: a transformers backbone plus a scalar head (the HF classes stay untouched)."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        hidden_BND = self.backbone(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
        values_BN: torch.Tensor = self.value_head(hidden_BND).squeeze(-1)
        return values_BN


def hf_config(cfg: ModelConfig) -> Any:
    from transformers import AutoConfig

    fields = builtin.random_config(cfg.path)
    if fields is not None:
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    try:
        return AutoConfig.from_pretrained(builtin.local_dir(cfg.path))
    except (OSError, ValueError) as err:
        raise EngineConfigError(
            f"cannot load model.path {cfg.path!r}: {err}. Give a local Hugging Face model directory "
            f"(config.json + weights), a hub name this machine can download, or one of "
            f"{', '.join(builtin.PREFIX + n for n in builtin.NAMES)}"
        ) from None


def build_model(cfg: ModelConfig, role: str = "actor", *, meta: bool = False) -> nn.Module:
    """The model of one role: loaded from ``cfg.path`` on the CPU, or (``meta=True``, and for
    random built-in models) built from the config alone; identical on every rank."""
    from transformers import AutoModel, AutoModelForCausalLM

    assert role in ROLES, role
    torch.manual_seed(cfg.seed)  # built-in random weights and the value head: the same on every rank
    config = hf_config(cfg)
    config.attention_dropout = 0.0
    from_config = meta or builtin.random_config(cfg.path) is not None
    source = builtin.local_dir(cfg.path)
    with torch.device("meta") if meta else contextlib.nullcontext():
        if role == "critic":
            if from_config:
                backbone = AutoModel.from_config(config, dtype=cfg.torch_dtype)
            else:
                backbone = AutoModel.from_pretrained(source, dtype=cfg.torch_dtype)
            model: nn.Module = ValueModel(backbone, config.hidden_size).to(cfg.torch_dtype)
            use_tree_attention(backbone)
        else:
            if from_config:
                model = AutoModelForCausalLM.from_config(config, dtype=cfg.torch_dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(source, dtype=cfg.torch_dtype)
            use_tree_attention(model)
    if cfg.gradient_checkpointing:
        target = model.backbone if isinstance(model, ValueModel) else model
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    return model


def load_sharded(cfg: ModelConfig, role: str, layout: ParallelLayout) -> nn.Module:
    """Several ranks, weights from a directory: build on the meta device, shard, then load.

    Only rank 0 reads the checkpoint (one full copy in host memory, not one per rank); every
    rank builds the model on the meta device (no memory), shards it, allocates just its
    shards (``to_empty``) and receives them from rank 0. Buffers that are not in the state
    dict (rotary frequencies) are broadcast from rank 0 too.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    source = build_model(cfg, role) if layout.is_main else None
    model = parallelize(build_model(cfg, role, meta=True), layout, cfg)
    model.to_empty(device=layout.device)
    full = source.state_dict() if source is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    src_buffers = dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if source is not None:
                buf.copy_(src_buffers[name])
            dist.broadcast(buf, src=0)
    del source, full
    return model


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList):
            return module
    raise EngineConfigError(f"{type(model).__name__} has no decoder `layers` list; the FSDP engine cannot shard it")


def parallelize(model: nn.Module, layout: ParallelLayout, cfg: ModelConfig) -> nn.Module:
    """Apply the parallel strategy in place, in this order:

    1. Tensor parallel (``t > 1``): shard attention and MLP projections with DTensor. It goes
       first because FSDP then shards the already tensor-parallel parameters over the
       data-parallel dimension (2-D), not the other way round.
    2. FSDP2 (``d > 1``): one ``fully_shard`` per decoder layer, so each layer's parameters
       are gathered just before it runs and freed after; then the root for the rest
       (embeddings, final norm, head). With ``d = 1`` nothing is sharded.
    """
    if layout.mesh is None:
        return model
    if layout.tp > 1:
        _apply_tp(model, layout)
    if layout.dp > 1:
        _apply_fsdp(model, layout)
    return model


def _apply_tp(model: nn.Module, layout: ParallelLayout) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    assert layout.mesh is not None
    config: Any = model.config
    tp = layout.tp
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    if heads % tp or kv_heads % tp or config.intermediate_size % tp:
        sizes = [t for t in range(1, kv_heads + 1) if not (heads % t or kv_heads % t or config.intermediate_size % t)]
        raise EngineConfigError(
            f"t{tp} must divide the attention heads ({heads}), key/value heads ({kv_heads}) "
            f"and MLP width ({config.intermediate_size}) of the model; fix: t in {{{', '.join(map(str, sizes))}}}"
        )
    # Column-parallel q/k/v and gate/up leave each rank its own heads / MLP slice; the
    # row-parallel o/down projections all-reduce back to a replicated hidden state, so the
    # norms, embeddings and head stay plain replicated modules.
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in _decoder_layers(model):
        try:
            for name in plan:
                layer.get_submodule(name)
        except AttributeError as err:
            raise EngineConfigError(f"tensor parallel expects Llama-style decoder layers: {err}") from None
        parallelize_module(layer, layout.mesh["tp"], plan)


def _apply_fsdp(model: nn.Module, layout: ParallelLayout) -> None:
    from torch.distributed.fsdp import fully_shard

    assert layout.mesh is not None
    mesh = layout.mesh["dp"]
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


@dataclass(slots=True)
class _Run:
    tensors: TreeTensors
    out: MicroBatchOutput
    anchor: torch.Tensor  # a scalar that touches every output (backward on empty trees)


class FSDPEngine(Engine):
    """Actor (log-probs) or critic (values) training on a Hugging Face model."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        layout: ParallelLayout,
        tree_cfg: TreeTrainingConfig,
        optim_cfg: OptimConfig | None = None,
        *,
        role: str = "actor",
    ) -> None:
        if role not in ROLES:
            raise EngineConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.model_cfg = model_cfg
        self.layout = layout
        self.tree_cfg = tree_cfg
        self.role = role
        self.block_size = block_size()
        # TREETRAIN_ATTENTION overrides the config (DESIGN.md). Trained roles need a backward:
        # a backend that has none on this device fails here, not inside the first step.
        name = os.environ.get("TREETRAIN_ATTENTION") or tree_cfg.attention
        self.attention = resolve(name, layout.device, needs_grad=optim_cfg is not None)
        # Fails early with the packer's message when max_tokens_per_mb does not fit the alignment.
        self._pack_config(tree=True)
        if layout.world_size > 1 and builtin.random_config(model_cfg.path) is None:
            self.model = load_sharded(model_cfg, role, layout)
        else:
            self.model = parallelize(build_model(model_cfg, role), layout, model_cfg).to(layout.device)
        self.optim_cfg = optim_cfg
        self.optimizer: torch.optim.Optimizer | None = None
        if optim_cfg is not None:
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=optim_cfg.lr,
                betas=optim_cfg.betas,
                eps=optim_cfg.eps,
                weight_decay=optim_cfg.weight_decay,
            )
        else:
            self.model.requires_grad_(False)
        self.steps = 0

    # -- packing ---------------------------------------------------------------------------
    def _pack_config(self, *, tree: bool) -> PackConfig:
        cfg = self.tree_cfg
        return PackConfig(
            max_tokens_per_mb=cfg.max_tokens_per_mb,
            block_size=self.block_size,
            parallel_size=self.layout.tp,
            dp_size=self.layout.dp,
            pad_to_max=cfg.pad_to_maximum,
            share_prefixes=tree,
        )

    def pack(self, sequences: Sequence[Sequence[int]], *, tree: bool | None = None) -> PackedBatch:
        use_tree = self.tree_cfg.enabled if tree is None else tree
        return pack(sequences, self._pack_config(tree=use_tree))

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
        loss_sum = torch.zeros((), device=device)
        stat_sums: dict[str, torch.Tensor] = {}
        trees = packed.rank_trees(self.layout.dp_rank)
        for tree_mb in trees:
            run = self._run(tree_mb, entropy=loss.needs_entropy)
            mask_M = _packed(batch.loss_mask, tree_mb, device)
            inputs = {k: _packed(v, tree_mb, device) for k, v in batch.tensors.items()}
            mb_loss, stats = loss(run.out, mask_M, inputs)
            ((mb_loss + run.anchor) * scale).backward()
            loss_sum += mb_loss.detach()
            for k, v in stats.items():
                stat_sums[k] = stat_sums.get(k, torch.zeros((), device=device)) + v.detach().float()
        names = sorted(stat_sums)
        sums = torch.stack([loss_sum, *(stat_sums[k] for k in names)])
        if self.layout.dp > 1:
            assert self.layout.mesh is not None
            dist.all_reduce(sums, group=self.layout.mesh["dp"].get_group())
        host = (sums / total).tolist()  # host sync: once per forward_backward, for logging
        s = packed.stats
        return StepStats(
            loss=host[0],
            stats=dict(zip(names, host[1:], strict=True)),
            loss_tokens=batch.num_loss_tokens(),
            original_tokens=s.original_tokens,
            tree_tokens=s.tree_tokens,
            padded_tokens=s.padded_tokens,
            micro_batches=len(trees),
        )

    @torch.no_grad()
    def forward(self, batch: Sequence[Sequence[int]], *, tree: bool | None = None) -> list[torch.Tensor]:
        """Per-sequence log-probs (actor, ref) or values (critic), ``len - 1`` each, on the CPU."""
        if not batch:
            return []
        self.model.eval()
        packed = self.pack(batch, tree=tree)
        mine: dict[int, torch.Tensor] = {}
        for tree_mb in packed.rank_trees(self.layout.dp_rank):
            run = self._run(tree_mb, entropy=False)
            flat = run.out.values if self.role == "critic" else run.out.logprobs
            assert flat is not None
            parts = torch.split(flat.float().cpu(), list(run.tensors.split_sizes))
            mine.update(zip(tree_mb.seq_ids, parts, strict=True))
        if self.layout.dp > 1:
            assert self.layout.mesh is not None
            gathered: list[Any] = [None] * self.layout.dp
            dist.all_gather_object(gathered, mine, group=self.layout.mesh["dp"].get_group())
            for part in gathered:
                mine.update(part)
        return [mine[i] for i in range(len(batch))]

    # -- optimizer -------------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        assert self.optimizer is not None and self.optim_cfg is not None
        cfg = self.optim_cfg
        norm = float(grad_norm(self.model.parameters()))  # host sync: once per step, logged too
        if cfg.max_grad_norm > 0 and norm > cfg.max_grad_norm:
            coef = cfg.max_grad_norm / (norm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        warm = cfg.warmup_steps
        lr = cfg.lr * min(1.0, (self.steps + 1) / warm) if warm else cfg.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return norm

    # -- checkpoints -----------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, path: Path, extra: Mapping[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        path.mkdir(parents=True, exist_ok=True)
        if self.layout.world_size > 1:
            dcp.save(self._state(), checkpoint_id=str(path / self.role))  # each rank writes its shards
        else:
            torch.save(self._state(), path / f"{self.role}.pt")  # one process: no collectives to plan
        rng = {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        meta = {"steps": self.steps, "rng": rng, "extra": dict(extra), "model": self.model_cfg.path}
        torch.save(meta, path / f"{self.role}-rank{self.layout.rank}.pt")

    def load(self, path: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        own = path / f"{self.role}-rank{self.layout.rank}.pt"
        if not own.exists():
            raise FileNotFoundError(f"{own} is missing: checkpoint {path} was written by a different number of ranks")
        meta = torch.load(own, weights_only=False)
        saved_model = meta.get("model", self.model_cfg.path)  # older checkpoints lack it
        if saved_model != self.model_cfg.path:
            raise EngineConfigError(
                f"checkpoint {path} was written for model {saved_model!r}, but this run trains "
                f"{self.model_cfg.path!r}; fix: give this run a new checkpoint.dir (or set model.path back)"
            )
        try:
            if self.layout.world_size > 1:
                state = self._state()
                dcp.load(state, checkpoint_id=str(path / self.role))
            else:
                state = torch.load(path / f"{self.role}.pt", weights_only=False)
            if self.optimizer is None:
                set_model_state_dict(self.model, state["model"])
            else:
                set_state_dict(
                    self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
                )
        except (RuntimeError, KeyError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise EngineConfigError(
                f"cannot resume the {self.role} from checkpoint {path}: {first}; fix: give this run a new "
                "checkpoint.dir if that checkpoint belongs to another model or layout"
            ) from None
        self.steps = int(meta["steps"])
        random.setstate(meta["rng"]["python"])
        torch.set_rng_state(meta["rng"]["torch"])
        if meta["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(meta["rng"]["cuda"])
        extra: dict[str, Any] = meta["extra"]
        return extra

    def export_hf(self, path: Path) -> None:
        """Full (unsharded) weights as safetensors + config; rank 0 writes, every rank joins."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.role == "critic":
            raise EngineConfigError("only an actor exports Hugging Face weights for rollout servers")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        if self.layout.is_main:
            path.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(str(path), state_dict=state)  # type: ignore[operator]
        if self.layout.world_size > 1:
            dist.barrier()

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients by parameter name (tests and parity scripts)."""
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().cpu().clone()
        return out


def grad_norm(params: Any) -> torch.Tensor:
    """Global L2 norm of the gradients, whatever mix of plain, FSDP and TP tensors they are."""
    squares = []
    for p in params:
        if p.grad is None:
            continue
        n = torch.linalg.vector_norm(p.grad.detach().float())
        if isinstance(n, DTensor):
            n = n.full_tensor()  # sums the shards' partial norms over their mesh
        squares.append(n.square())
    if not squares:
        return torch.zeros(())
    return torch.stack([s.cpu() for s in squares]).sum().sqrt()


def _packed(values: Sequence[torch.Tensor], tree: PackedTree, device: torch.device) -> torch.Tensor:
    """Per-sequence tensors (input order) in the layout order of ``tree``: the log-prob order."""
    if not tree.seq_ids:
        return torch.zeros(0, device=device, dtype=values[0].dtype if values else torch.float32)
    return torch.cat([values[i] for i in tree.seq_ids]).to(device)
