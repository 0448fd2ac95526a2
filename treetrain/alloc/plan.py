"""Memory per GPU of a training engine (or a rollout server's weights) before launch.

Plain Python, no torch. Static parts (parameters, gradients, optimizer state) are exact:
every parameter tensor from :mod:`.shapes`, sliced the way the engine slices it and counted in
the dtype the precision rule (:mod:`.precision`) says the engine keeps it in. Activations are
the estimate of :mod:`.activations`. With a LoRA adapter (:mod:`.lora`) the base is frozen in the
compute dtype with neither gradients nor optimizer state, and only the fp32 adapter has both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from treetrain.alloc import registry
from treetrain.alloc.activations import activation_bytes
from treetrain.alloc.lora import ATTENTION_TARGETS, FFN_TARGETS, LoraShape, adapter_params
from treetrain.alloc.model import Allocation, ParallelDims
from treetrain.alloc.precision import DTYPE_BYTES, Precision, fsdp_group, precision, resolve_dtype
from treetrain.alloc.registry import spec_of
from treetrain.alloc.shapes import (
    MemoryInputError,
    ModelShape,
    Param,
    ceil_div,
    check_layout,
    local_numel,
    stage_params,
    stage_split,
)
from treetrain.alloc.spec import EngineSpec

GIB = 1024**3
ROLES = ("actor", "critic", "ref")


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes one rank holds (``stage``: its pipeline stage)."""

    stage: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    param_count: int  # elements of this rank's parameter tensors
    param_dtype: str
    trainable: int  # elements the optimizer steps on this rank (all of them; with LoRA the adapter's)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    @property
    def static(self) -> int:
        """Parameters, gradients and optimizer state: what does not depend on the tokens."""
        return self.parameters + self.gradients + self.optimizer

    def to_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
        }


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Per-stage memory of one engine; ``largest`` is the rank that needs the most. ``dtype``
    is the resolved ``model.dtype`` (``auto`` planned as bfloat16: the plan is for GPUs)."""

    allocation: Allocation
    role: str
    dtype: str
    tokens: int
    recompute: bool
    ranks: tuple[RankMemory, ...]
    notes: tuple[str, ...] = field(default=())
    in_flight: int | None = None  # as given to estimate (None: the schedule's default)
    lora: LoraShape | None = None  # as given to estimate (None: every weight trains)

    @property
    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def precision(self) -> Precision:
        return precision(self.allocation.backend, self.allocation.dims, self.dtype, lora=self.lora is not None)

    def to_dict(self) -> dict[str, Any]:
        p = self.precision
        lora = None if self.lora is None else {"rank": self.lora.rank, "targets": list(self.lora.targets)}
        return {
            "per_rank": self.largest.to_dict(),
            "backend": str(self.allocation),
            "role": self.role,
            "dtype": self.dtype,
            "max_tokens": self.tokens,
            "recompute": self.recompute,
            "param_dtype": self.largest.param_dtype,
            "fp32_master_weights": p.master,
            "trainable_per_rank": self.largest.trainable,
            "lora": lora,
            "stages": [{"stage": r.stage, **r.to_dict()} for r in self.ranks],
            "notes": list(self.notes),
        }


def plan_dtype(dtype: str) -> str:
    """``model.dtype`` as the memory plan counts it: ``auto`` is bfloat16 (the plan is for
    GPUs, where the trainer resolves it so); an unknown name is a :class:`MemoryInputError`."""
    try:
        return resolve_dtype(dtype, cuda=True)
    except ValueError as err:
        raise MemoryInputError(str(err), "use auto, bfloat16, float16 or float32") from None


def estimate(
    config: Mapping[str, Any] | ModelShape,
    allocation: Allocation,
    *,
    tokens: int,
    dtype: str = "auto",
    role: str = "actor",
    recompute: bool = False,
    in_flight: int | None = None,
    lora: LoraShape | None = None,
) -> MemoryPlan:
    """Memory per rank of ``allocation`` (a training backend) for one role.

    ``tokens``: tree tokens of one micro-batch (``max_tokens_per_mb``). ``dtype``:
    ``model.dtype`` (``auto``: bfloat16, see :func:`plan_dtype`). ``in_flight``: micro-batches
    whose activations a pipeline stage holds at once (default: ``p``, what a 1F1B schedule's
    first stage holds; a GPipe schedule holds every micro-batch of a step). A reference model
    (``role="ref"``) has no gradients or optimizer state. ``lora``: the actor's adapter
    (``actor.lora``): the base frozen in the compute dtype, the adapter fp32 with fp32 gradients
    and AdamW state (the precision rule's LoRA case)."""
    m = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    if allocation.kind != "training":
        raise MemoryInputError(f"{allocation} is a rollout server", "see server_weight_bytes for servers")
    if role not in ROLES:
        raise MemoryInputError(f"role {role!r} is not one of {', '.join(ROLES)}", "use actor, critic or ref")
    dtype = plan_dtype(dtype)
    if tokens < 1:
        raise MemoryInputError(f"max tokens {tokens} is not >= 1", "give the micro-batch's tree tokens")
    engine, dims = allocation.backend, allocation.dims
    check_layout(m, engine, dims)
    if lora is not None:
        _check_lora(m, allocation.spec, dims, role, lora)
    split = stage_split(m, engine, dims.pp, tokens=tokens, role=role) if dims.pp > 1 else [range(m.layers)]
    prec = precision(engine, dims, dtype, lora=lora is not None)
    stepped = _stepped(prec)  # what the optimizer steps: the weights, or the fp32 adapter
    pbytes, sbytes = DTYPE_BYTES[prec.params], DTYPE_BYTES[stepped.params]
    trained = role != "ref"
    ranks: list[RankMemory] = []
    for s, layers in enumerate(split):
        first, last = s == 0, s == dims.pp - 1
        params = stage_params(m, role, layers, first=first, last=last, tp_vocab=allocation.spec.vocab_parallel)
        counts = [(p, local_numel(p, engine, dims)) for p in params]
        adapter = [(p, local_numel(p, engine, dims)) for p in adapter_params(params, lora)] if lora else []
        steps = adapter if lora else counts
        base, numel = sum(n for _, n in counts), sum(n for _, n in steps)
        grads = numel * sbytes + (_replicated_grad_bytes(m, engine, dims, prec, first=first) if not lora else 0)
        ranks.append(
            RankMemory(
                stage=s,
                parameters=base * pbytes + (numel * sbytes if lora else 0),
                gradients=grads if trained else 0,
                optimizer=_optimizer_bytes(engine, dims, steps, stepped) if trained else 0,
                activations=activation_bytes(
                    m,
                    allocation,
                    layers=layers,
                    last=last,
                    tokens=tokens,
                    dtype=dtype,
                    role=role,
                    recompute=recompute,
                    in_flight=(in_flight or dims.pp) if dims.pp > 1 else 1,
                    gathered=_gathered_bytes(counts + adapter, steps, engine, dims, prec),
                ),
                param_count=base + (numel if lora else 0),
                param_dtype=prec.params,
                trainable=numel if trained else 0,
            )
        )
    notes = ["activations are an estimate for one micro-batch (see docs/engines.md, Memory plan)"]
    if dims.pp > 1:
        notes.append(f"pipeline stages hold {in_flight or dims.pp} micro-batches' activations at once")
    if lora is not None and not allocation.spec.lora:
        notes.append(f"the {engine} engine does not train LoRA yet: these are the bytes it would hold")
    return MemoryPlan(allocation, role, dtype, tokens, recompute, tuple(ranks), tuple(notes), in_flight, lora)


def _check_lora(m: ModelShape, spec: EngineSpec, dims: ParallelDims, role: str, lora: LoraShape) -> None:
    """What the plan cannot count with an adapter: a critic or ref (only the actor has one),
    adapters on experts where the engine puts none, and on experts split by an ffn ``t`` (no
    engine builds them)."""
    if role != "actor":
        raise MemoryInputError(f"LoRA adapts the actor, not the {role}", "plan the actor with LoRA, the others without")
    if m.is_moe and not spec.lora_experts and set(lora.targets) & set(FFN_TARGETS):
        able = [n for n in registry.names("training") if spec_of(n).lora and spec_of(n).lora_experts]
        others = registry.either(f"{n}:..." for n in able)
        raise MemoryInputError(
            f"the {spec.name} engine puts no adapters on a mixture-of-experts layer's experts",
            f"target {', '.join(ATTENTION_TARGETS)} only, or use a backend {others}",
            "actor.lora.targetModules",
        )
    if m.is_moe and dims.etp > 1 and set(lora.targets) & set(FFN_TARGETS):
        raise MemoryInputError(
            f"adapters on experts split by an ffn t{dims.etp} are not built",
            "drop the ffn t, or target attention only",
            "actor.lora.targetModules",
        )


def _stepped(prec: Precision) -> Precision:
    """The precision of what the optimizer steps: the weights themselves, or with LoRA the fp32
    adapter (no master copy: it is fp32 already)."""
    if prec.adapter is None:
        return prec
    return Precision(compute=prec.compute, params=prec.adapter, fsdp=prec.fsdp)


def _optimizer_bytes(engine: str, dims: ParallelDims, counts: list[tuple[Param, int]], prec: Precision) -> int:
    """AdamW state: exp_avg and exp_avg_sq in the parameter dtype (fp32 by the precision
    rule) plus a 4-byte step per tensor (torch's AdamW). A ``sharded_optimizer`` engine's ZeRO-1
    (Megatron, ``engines/zero.py``, used as soon as the dense weights' data x context group or
    the experts' expert-data group has several ranks, or the weights are bf16) keeps, per
    bucket, fp32 moments (and an fp32 master copy of bf16 weights) for its ``1/(d*c)`` share of
    the dense elements and ``1/edp`` share of the expert ones, and one step."""
    if spec_of(engine).sharded_optimizer:
        dense = sum(n for p, n in counts if not p.expert)
        expert = sum(n for p, n in counts if p.expert)
        buckets = [(n, size) for n, size in ((dense, dims.dp * dims.cp), (expert, dims.edp)) if n]
        if prec.master or any(size > 1 for _, size in buckets):
            per_element = 12 if prec.master else 8
            return sum(ceil_div(n, size) * per_element + 4 for n, size in buckets)
    numel = sum(n for _, n in counts)
    return 2 * numel * DTYPE_BYTES[prec.params] + 4 * len(counts)


def _replicated_grad_bytes(m: ModelShape, engine: str, dims: ParallelDims, prec: Precision, *, first: bool) -> int:
    """What a gradient holds beyond its parameter's shard: a ``whole_embedding_grad`` engine's
    vocabulary-parallel embedding (Archon) gets a whole (replicated) ``[V, h]`` gradient on
    every tensor rank when FSDP does not wrap the model (fp32 at ``d*c = 1``) and so nothing
    reduce-scatters it."""
    if not spec_of(engine).whole_embedding_grad or dims.tp == 1 or prec.fsdp or not first:
        return 0
    return (m.vocab - m.vocab // dims.tp) * m.hidden * DTYPE_BYTES[prec.params]


def _gathered_bytes(
    counts: list[tuple[Param, int]], steps: list[tuple[Param, int]], engine: str, dims: ParallelDims, prec: Precision
) -> int:
    """FSDP's working copies: the largest layer gathered whole in the compute dtype, twice
    (the running layer and the prefetched one), and the gradient of what it trains before the
    reduce-scatter (fp32; with LoRA the adapter's only). Zero when FSDP does not wrap the
    model; on one rank the gathered layer is the 16-bit cast of the fp32 weights."""
    if not prec.fsdp:
        return 0
    group = fsdp_group(engine, dims)
    per_layer: dict[str, int] = {}
    for p, n in counts:
        key = p.name.split(".")[0]
        per_layer[key] = per_layer.get(key, 0) + n * group * 2 * DTYPE_BYTES[prec.compute]
    for p, n in steps:
        key = p.name.split(".")[0]
        per_layer[key] = per_layer.get(key, 0) + n * group * 4
    return max(per_layer.values())


def server_weight_bytes(config: Mapping[str, Any] | ModelShape, allocation: Allocation, dtype: str = "auto") -> int:
    """Weights per GPU of one sglang/vllm instance (``t * p`` GPUs), on its fullest GPU: layers
    split evenly over the pipeline stages, every matrix (embedding, head and experts too)
    over the tensor ranks. The server fills the rest of the GPU with its KV cache (its memory
    fraction) and CUDA graphs."""
    m = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    d = allocation.dims
    per = ceil_div(m.layers, d.pp)
    worst = 0
    for s in range(d.pp):
        layers = range(s * per, min(m.layers, (s + 1) * per))
        params = stage_params(m, "actor", layers, first=s == 0, last=s == d.pp - 1, tp_vocab=True)
        split = sum(p.numel // d.tp if p.tp_dim is not None or p.expert else p.numel for p in params)
        worst = max(worst, split)
    return worst * DTYPE_BYTES[plan_dtype(dtype)]


def gib(n: int) -> str:
    return f"{n / GIB:.1f}"
