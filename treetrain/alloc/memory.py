"""Memory per GPU of a training engine (or a rollout server's weights) before launch.

Plain Python, no torch: the operator imports this to refuse a layout that cannot fit.

Static parts (parameters, gradients, optimizer state) are exact: every parameter tensor of
the model is listed from the Hugging Face config, sliced the way each engine slices it
(tensor, pipeline, expert and FSDP sharding) and counted in the dtype the engine keeps it
in. Activations are an estimate of what one micro-batch of ``N`` tree tokens keeps for its
backward pass (see :func:`activation_bytes`); they are calibrated against CPU peaks of
``bench/tree_memory.py`` and documented in docs/engines.md ("Memory plan").

Letters: h hidden size, I FFN width, V vocabulary, H query heads, K key/value heads, D head
dim, E experts, N tree tokens of one micro-batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treetrain.alloc.model import Allocation, ParallelDims

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ROLES = ("actor", "critic", "ref")
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
# Rows of logits whose fp32 log-softmax is worked on at once (treetrain.logprob's default).
LOGPROB_CHUNK = 1024
# Measured CPU peak over the saved tensors listed in activation_bytes (bench/tree_memory.py,
# tiny Llama, fp32, 4k and 16k tree tokens, once the CPU attention kernel's scores are taken
# out: docs/engines.md, "Memory plan"): autograd's extra copies and allocator slack.
ACTIVATION_SLACK = {"fsdp": 1.15, "archon": 1.1, "megatron": 1.3}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


class MemoryInputError(ValueError):
    """A model config or layout the estimator cannot read, with the fix."""

    def __init__(self, message: str, fix: str) -> None:
        self.message, self.fix = message, fix
        super().__init__(f"{message}; fix: {fix}")


def read_config(path: str) -> dict[str, Any]:
    """The config dict of a model directory (its config.json) or of a JSON file."""
    target = Path(path)
    if target.is_dir():
        target = target / "config.json"
    try:
        config = json.loads(target.read_text())
    except FileNotFoundError:
        raise MemoryInputError(
            f"no file {target}", "give a model directory with config.json, or the JSON file"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MemoryInputError(f"cannot read {target}: {err}", "give a Hugging Face config.json") from None
    if not isinstance(config, dict):
        raise MemoryInputError(f"{target} is not a JSON object", "give a Hugging Face config.json")
    return config


# -- the model --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The architecture numbers of a Llama / Qwen2 / Qwen3 (-MoE) config."""

    family: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    qkv_bias: bool = False
    qk_norm: bool = False
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Read a config.json dict; missing or non-numeric fields raise :class:`MemoryInputError`."""
        if not isinstance(config, Mapping):
            raise MemoryInputError("the model config is not a JSON object", "give the model's config.json")
        missing = [k for k in REQUIRED if k not in config]
        family = str(config.get("model_type", "llama"))
        if family not in FAMILIES:
            raise MemoryInputError(
                f"model_type {family!r} is not one the engines build", f"use one of {', '.join(FAMILIES)}"
            )
        moe = family == "qwen3_moe"
        if moe and "num_experts" not in config and "num_local_experts" in config:
            # transformers >= 5 writes the expert count as num_local_experts.
            config = {**config, "num_experts": config["num_local_experts"]}
        if moe:
            missing += [k for k in ("num_experts", "moe_intermediate_size", "num_experts_per_tok") if k not in config]
        elif "intermediate_size" not in config:
            missing.append("intermediate_size")
        if missing:
            raise MemoryInputError(
                f"the model config has no {', '.join(missing)}", "give the model's full Hugging Face config.json"
            )
        heads = _positive(config, "num_attention_heads")
        hidden = _positive(config, "hidden_size")
        layers = _positive(config, "num_hidden_layers")
        experts = _positive(config, "num_experts") if moe else 0
        moe_layers: tuple[int, ...] = ()
        if moe:
            step = _positive(config, "decoder_sparse_step", 1)
            dense = set(config.get("mlp_only_layers") or ())
            moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return cls(
            family=family,
            vocab=_positive(config, "vocab_size"),
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=_positive(config, "num_key_value_heads", heads),
            head_dim=_positive(config, "head_dim", hidden // heads),
            ffn=_positive(config, "intermediate_size", 1),
            qkv_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tied=bool(config.get("tie_word_embeddings", False)),
            experts=experts,
            top_k=_positive(config, "num_experts_per_tok") if moe else 0,
            moe_ffn=_positive(config, "moe_intermediate_size") if moe else 0,
            moe_layers=moe_layers,
        )

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)


def _positive(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MemoryInputError(f"the model config's {key} is {value!r}, not a whole number >= 1", f"set {key}")
    return value


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter tensor: its full shape and how tensor parallel slices it.

    ``tp_dim``: the dimension split over the tensor ranks (None: every tensor rank holds it
    whole). ``expert``: an expert weight ``[E, a, b]`` (experts on dim 0, ``ffn_dim`` the FFN
    width that expert tensor parallel splits, the other the model width that FSDP shards)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    expert: bool = False
    ffn_dim: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def layer_params(m: ModelShape, i: int) -> list[Param]:
    """The parameters of decoder layer ``i``: q/k/v and the FFN's gate/up are column parallel
    (rows split over t), o and down row parallel (columns split)."""
    h, hd, kd = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    out = [
        Param(f"{i}.attention_norm", (h,)),
        Param(f"{i}.wq", (hd, h), 0),
        Param(f"{i}.wk", (kd, h), 0),
        Param(f"{i}.wv", (kd, h), 0),
        Param(f"{i}.wo", (h, hd), 1),
        Param(f"{i}.ffn_norm", (h,)),
    ]
    if m.qkv_bias:
        out += [Param(f"{i}.bq", (hd,), 0), Param(f"{i}.bk", (kd,), 0), Param(f"{i}.bv", (kd,), 0)]
    if m.qk_norm:
        out += [Param(f"{i}.q_norm", (m.head_dim,)), Param(f"{i}.k_norm", (m.head_dim,))]
    if i in m.moe_layers:
        e, f = m.experts, m.moe_ffn
        out += [
            Param(f"{i}.router", (e, h)),
            Param(f"{i}.experts.w1", (e, f, h), expert=True, ffn_dim=1),
            Param(f"{i}.experts.w3", (e, f, h), expert=True, ffn_dim=1),
            Param(f"{i}.experts.w2", (e, h, f), expert=True, ffn_dim=2),
        ]
    else:
        out += [Param(f"{i}.w1", (m.ffn, h), 0), Param(f"{i}.w3", (m.ffn, h), 0), Param(f"{i}.w2", (h, m.ffn), 1)]
    return out


def stage_params(
    m: ModelShape, role: str, layers: Sequence[int], *, first: bool, last: bool, tp_vocab: bool
) -> list[Param]:
    """A pipeline stage's parameters: its layers, the embedding on the first stage, the final
    norm and head on the last (a critic's head is one value per token, with a bias). A tied
    head is the embedding itself when one stage holds both; across stages each keeps a copy.
    ``tp_vocab``: the embedding and LM head are split over the tensor ranks by vocabulary."""
    vocab_dim = 0 if tp_vocab else None
    out: list[Param] = []
    if first:
        out.append(Param("embedding", (m.vocab, m.hidden), vocab_dim))
    for i in layers:
        out += layer_params(m, i)
    if last:
        out.append(Param("norm", (m.hidden,)))
        if role == "critic":
            out += [Param("value_head.weight", (1, m.hidden)), Param("value_head.bias", (1,))]
        elif not (m.tied and first):
            out.append(Param("output", (m.vocab, m.hidden), vocab_dim))
    return out


def total_params(m: ModelShape) -> int:
    """Parameters of the whole (actor) model, a tied head counted once."""
    return sum(p.numel for p in stage_params(m, "actor", range(m.layers), first=True, last=True, tp_vocab=False))


# -- the Archon pipeline split (the pure twin of archon/pipeline.py's stage_layers) -----------


def archon_layer_costs(m: ModelShape, tokens: int) -> list[float]:
    """Forward FLOPs per layer on a tree of ``tokens`` tokens (attention at a full causal mask)."""
    d, hd = m.hidden, m.heads * m.head_dim
    proj = 2 * d * (hd + 2 * m.kv_heads * m.head_dim) + 2 * hd * d
    attention = 2 * hd * (tokens + 1)  # q.k and p.v, each query over (tokens + 1) / 2 keys on average
    dense = 6 * d * m.ffn
    moe = 2 * d * m.experts + m.top_k * 6 * d * m.moe_ffn
    return [float(tokens * (proj + attention + (moe if i in m.moe_layers else dense))) for i in range(m.layers)]


def archon_head_cost(m: ModelShape, tokens: int, *, value_head: bool) -> float:
    head = 2 * m.hidden + 1 if value_head else 2 * m.hidden * m.vocab + 4 * m.vocab
    return float(tokens * (4 * m.hidden + head))


def split_min_max(costs: Sequence[float], stages: int, *, first: float = 0.0, last: float = 0.0) -> list[range]:
    """Contiguous ranges, one per stage and at least one layer each, minimising the costliest
    stage; the first stage also pays ``first`` (the embedding), the last ``last`` (the head).
    Among equal splits the later start wins, so earlier stages take more layers. The Archon
    engine splits its pipeline stages with this function (``archon/pipeline.py``)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise MemoryInputError(f"p{stages} needs at least {stages} layers, the model has {n}", f"use p <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, i: int, j: int) -> float:
        return prefix[j] - prefix[i] + (first if s == 0 else 0.0) + (last if s == stages - 1 else 0.0)

    inf = float("inf")
    # cheapest[s][j]: the best costliest stage when stages 0..s hold layers [0, j).
    cheapest = [[inf] * (n + 1) for _ in range(stages)]
    begin = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        cheapest[0][j] = stage_cost(0, 0, j)
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                worst = max(cheapest[s - 1][i], stage_cost(s, i, j))
                if worst <= cheapest[s][j]:
                    cheapest[s][j], begin[s][j] = worst, i
    bounds = [n]
    for s in range(stages - 1, 0, -1):
        bounds.append(begin[s][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(stages)]


def stage_split(m: ModelShape, engine: str, pp: int, *, tokens: int, role: str) -> list[range]:
    """Which layers each pipeline stage holds: Archon balances FLOPs, Megatron splits evenly."""
    if engine == "archon":
        costs = archon_layer_costs(m, tokens)
        return split_min_max(costs, pp, last=archon_head_cost(m, tokens, value_head=role == "critic"))
    if m.layers % pp:
        fits = [p for p in range(1, m.layers + 1) if m.layers % p == 0]
        raise MemoryInputError(
            f"{m.layers} layers do not split over p{pp}", f"p in {{{', '.join(map(str, fits[:12]))}}}"
        )
    each = m.layers // pp
    return [range(s * each, (s + 1) * each) for s in range(pp)]


# -- slicing ----------------------------------------------------------------------------------


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def local_numel(p: Param, engine: str, dims: ParallelDims) -> int:
    """Elements of ``p`` on the rank that holds the most of it.

    Tensor parallel divides ``tp_dim``; experts split over ``ep`` by expert and over ``etp``
    by FFN width. FSDP (fsdp, archon) then shards dim 0 of a dense tensor over the data (x
    context) ranks and an expert tensor's model width over the expert-data ranks, in
    ``torch.chunk`` pieces (the first ranks get the rounded-up share). Megatron replicates
    parameters over data ranks (its ZeRO-1 shards only the optimizer)."""
    shape = list(p.shape)
    if p.expert:
        shape[0] //= dims.ep
        shape[p.ffn_dim] //= dims.etp
    elif p.tp_dim is not None:
        shape[p.tp_dim] //= dims.tp
    if engine == "fsdp" and dims.dp > 1:
        shape[0] = _ceil(shape[0], dims.dp)
    elif engine == "archon" and dims.dp * dims.cp > 1:
        if p.expert and dims.ep * dims.etp > 1:
            width = 3 - p.ffn_dim  # w1/w3 [E, I, h]: h is dim 2; w2 [E, h, I]: dim 1
            shape[width] = _ceil(shape[width], dims.edp)
        else:
            shape[0] = _ceil(shape[0], dims.dp * dims.cp)
    return math.prod(shape)


def check_layout(m: ModelShape, engine: str, dims: ParallelDims) -> None:
    """The engines' own refusals that change the count: what t, e and ffn t must divide."""
    t = dims.tp
    if engine == "fsdp" and dims.cp > 1:
        raise MemoryInputError("the FSDP engine does not run context parallel (c)", "drop c and raise d or t")
    if engine == "archon" and m.is_moe and t > 1:
        raise MemoryInputError(
            "the archon engine has no tensor parallel on a mixture-of-experts model", "shard experts with e, raise d"
        )
    sizes = {"attention heads": m.heads, "key/value heads": m.kv_heads, "FFN width": m.ffn}
    if engine != "fsdp":
        sizes["vocabulary"] = m.vocab
    for what, n in sizes.items():
        if n % t:
            fits = [k for k in range(1, m.kv_heads + 1) if all(v % k == 0 for v in sizes.values())]
            raise MemoryInputError(f"t{t} does not divide the {what} ({n})", f"t in {{{', '.join(map(str, fits))}}}")
    if dims.ep > 1 or dims.etp > 1:
        if not m.is_moe:
            raise MemoryInputError(f"e{dims.ep} shards experts, but this model has none", "drop e")
        if m.experts % dims.ep:
            fits = [k for k in range(1, m.experts + 1) if m.experts % k == 0]
            raise MemoryInputError(f"e{dims.ep} does not divide the {m.experts} experts", f"e in {set(fits)}")
        if m.moe_ffn % dims.etp:
            raise MemoryInputError(f"ffn t{dims.etp} does not divide the expert FFN width ({m.moe_ffn})", "pick ffn t")


# -- the estimate -----------------------------------------------------------------------------


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

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

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
    """Per-stage memory of one engine; ``largest`` is the rank that needs the most."""

    allocation: Allocation
    role: str
    dtype: str
    tokens: int
    recompute: bool
    ranks: tuple[RankMemory, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    def to_dict(self) -> dict[str, Any]:
        return {
            "per_rank": self.largest.to_dict(),
            "backend": str(self.allocation),
            "role": self.role,
            "dtype": self.dtype,
            "max_tokens": self.tokens,
            "recompute": self.recompute,
            "param_dtype": self.largest.param_dtype,
            "stages": [{"stage": r.stage, **r.to_dict()} for r in self.ranks],
            "notes": list(self.notes),
        }


def param_dtype(engine: str, dims: ParallelDims, dtype: str) -> str:
    """The dtype each engine stores (and steps) its parameters in: FSDP-sharded engines keep
    fp32 master weights when they shard (fsdp d > 1, archon d*c > 1) and compute in 16 bits;
    Megatron keeps bf16 parameters for ``model.dtype: bfloat16`` (fp32 master weights in its
    optimizer) and fp32 ones otherwise (float16 runs under autocast)."""
    if dtype == "float32":
        return dtype
    if engine == "fsdp":
        return "float32" if dims.dp > 1 else dtype
    if engine == "archon":
        return "float32" if dims.dp * dims.cp > 1 else dtype
    return "bfloat16" if dtype == "bfloat16" else "float32"


def estimate(
    config: Mapping[str, Any] | ModelShape,
    allocation: Allocation,
    *,
    tokens: int,
    dtype: str = "bfloat16",
    role: str = "actor",
    recompute: bool = False,
    in_flight: int | None = None,
) -> MemoryPlan:
    """Memory per rank of ``allocation`` (a training backend) for one role.

    ``tokens``: tree tokens of one micro-batch (``max_tokens_per_mb``). ``in_flight``:
    micro-batches whose activations a pipeline stage holds at once (default: ``p``, what a
    1F1B schedule's first stage holds; a GPipe schedule holds every micro-batch of a step).
    A reference model (``role="ref"``) has no gradients or optimizer state."""
    m = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    if allocation.kind != "training":
        raise MemoryInputError(f"{allocation} is a rollout server", "see server_weight_bytes for servers")
    if role not in ROLES:
        raise MemoryInputError(f"role {role!r} is not one of {', '.join(ROLES)}", "use actor, critic or ref")
    if dtype not in DTYPE_BYTES:
        raise MemoryInputError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}", "use bfloat16 or float32")
    if tokens < 1:
        raise MemoryInputError(f"max tokens {tokens} is not >= 1", "give the micro-batch's tree tokens")
    engine, dims = allocation.backend, allocation.dims
    check_layout(m, engine, dims)
    split = stage_split(m, engine, dims.pp, tokens=tokens, role=role) if dims.pp > 1 else [range(m.layers)]
    pdtype = param_dtype(engine, dims, dtype)
    pbytes = DTYPE_BYTES[pdtype]
    trained = role != "ref"
    ranks: list[RankMemory] = []
    for s, layers in enumerate(split):
        params = stage_params(m, role, layers, first=s == 0, last=s == dims.pp - 1, tp_vocab=engine != "fsdp")
        counts = [(p, local_numel(p, engine, dims)) for p in params]
        numel = sum(n for _, n in counts)
        optimizer = 0
        if trained:
            optimizer = _optimizer_bytes(engine, dims, counts, pdtype)
        ranks.append(
            RankMemory(
                stage=s,
                parameters=numel * pbytes,
                gradients=numel * pbytes + _replicated_grad_bytes(m, engine, dims, first=s == 0, pbytes=pbytes)
                if trained
                else 0,
                optimizer=optimizer,
                activations=activation_bytes(
                    m,
                    allocation,
                    layers=layers,
                    last=s == dims.pp - 1,
                    tokens=tokens,
                    dtype=dtype,
                    role=role,
                    recompute=recompute,
                    in_flight=(in_flight or dims.pp) if dims.pp > 1 else 1,
                    gathered=_gathered_bytes(counts, engine, dims, dtype, pdtype),
                ),
                param_count=numel,
                param_dtype=pdtype,
            )
        )
    notes = ["activations are an estimate for one micro-batch (see docs/engines.md, Memory plan)"]
    if dims.pp > 1:
        notes.append(f"pipeline stages hold {in_flight or dims.pp} micro-batches' activations at once")
    return MemoryPlan(allocation, role, dtype, tokens, recompute, tuple(ranks), tuple(notes))


def _optimizer_bytes(engine: str, dims: ParallelDims, counts: list[tuple[Param, int]], pdtype: str) -> int:
    """AdamW state: exp_avg and exp_avg_sq in the parameter dtype plus a 4-byte step per
    tensor (torch's AdamW). Megatron's ZeRO-1 (``engines/zero.py``, used as soon as the dense
    weights' data x context group or the experts' expert-data group has several ranks, or the
    weights are bf16) keeps, per bucket, fp32 moments (and an fp32 master copy of bf16
    weights) for its ``1/(d*c)`` share of the dense elements and ``1/edp`` share of the expert
    ones, and one step."""
    if engine == "megatron":
        dense = sum(n for p, n in counts if not p.expert)
        expert = sum(n for p, n in counts if p.expert)
        buckets = [(n, size) for n, size in ((dense, dims.dp * dims.cp), (expert, dims.edp)) if n]
        if pdtype != "float32" or any(size > 1 for _, size in buckets):
            per_element = 8 if pdtype == "float32" else 12
            return sum(_ceil(n, size) * per_element + 4 for n, size in buckets)
    numel = sum(n for _, n in counts)
    return 2 * numel * DTYPE_BYTES[pdtype] + 4 * len(counts)


def _replicated_grad_bytes(m: ModelShape, engine: str, dims: ParallelDims, *, first: bool, pbytes: int) -> int:
    """What a gradient holds beyond its parameter's shard: Archon's vocabulary-parallel
    embedding gets a whole (replicated) ``[V, h]`` gradient on every tensor rank when no FSDP
    reduce-scatters it (d*c = 1)."""
    if engine != "archon" or dims.tp == 1 or dims.dp * dims.cp > 1 or not first:
        return 0
    return (m.vocab - m.vocab // dims.tp) * m.hidden * pbytes


def _gathered_bytes(counts: list[tuple[Param, int]], engine: str, dims: ParallelDims, dtype: str, pdtype: str) -> int:
    """FSDP's working copies: the largest layer gathered whole in the compute dtype, twice
    (the running layer and the prefetched one), and its gradient before the reduce-scatter
    (fp32). Zero when nothing is sharded."""
    group = dims.dp if engine == "fsdp" else dims.dp * dims.cp if engine == "archon" else 1
    if group == 1:
        return 0
    per_layer: dict[str, int] = {}
    for p, n in counts:
        key = p.name.split(".")[0]
        per_layer[key] = per_layer.get(key, 0) + n * group
    biggest = max(per_layer.values())
    return biggest * (2 * DTYPE_BYTES[dtype] + 4)


def activation_bytes(
    m: ModelShape,
    allocation: Allocation,
    *,
    layers: Sequence[int],
    last: bool,
    tokens: int,
    dtype: str,
    role: str,
    recompute: bool,
    in_flight: int = 1,
    gathered: int = 0,
) -> int:
    """An estimate of one stage's activation memory for micro-batches of ``tokens`` tree tokens.

    Per token of a layer, the tensors autograd saves: ~6 hidden-size tensors (norm inputs and
    outputs, residuals), q, k, v and the attention output, the FFN's gate, up, activation and
    product (an MoE layer: each routed copy's input and FFN tensors, and fp32 router
    probabilities). Context parallel gives a rank ``N / c`` rows; tensor parallel divides the
    head and FFN tensors, and in Megatron and Archon (sequence parallel) the hidden-size ones
    too. Recompute keeps one hidden state per layer plus one layer's tensors. The last stage
    adds the logits and their gradient (``V / t`` columns where the head is vocabulary
    parallel) and the fp32 log-softmax chunk. A reference model saves nothing for a backward:
    one layer's tensors and the logits. Tree attention keeps no ``N x N`` matrix. The sum is
    multiplied by the engine's :data:`ACTIVATION_SLACK`, fitted to measured CPU peaks."""
    d = allocation.dims
    engine = allocation.backend
    b = DTYPE_BYTES[dtype]
    n = _ceil(tokens, d.cp)
    sp = d.tp if engine in ("megatron", "archon") else 1
    h, t = m.hidden, d.tp
    attn = (2 * m.heads + 2 * m.kv_heads) * m.head_dim // t
    if engine == "megatron" and d.cp > 1:
        attn += 2 * m.kv_heads * m.head_dim * (d.cp - 1) // t  # K and V of the whole tree

    moe_ffn = m.top_k * (h + 4 * m.moe_ffn / d.etp) + h + 2 * m.experts * 4 / b  # routed copies, router
    dense_ffn = 4 * m.ffn / t

    def layer(i: int) -> float:
        return n * (6 * h / sp + attn + (moe_ffn if i in m.moe_layers else dense_ffn)) * b

    per_layer = [layer(i) for i in layers] or [0.0]
    if role == "ref":
        stored = max(per_layer)
    elif recompute:
        stored = len(layers) * n * h / sp * b + max(per_layer)
    else:
        stored = sum(per_layer)
    stored *= in_flight
    if last and role != "critic":
        cols = m.vocab // t if engine != "fsdp" else m.vocab
        copies = 1 if role == "ref" else 2  # the logits, and their gradient in the backward
        stored += n * cols * b * copies + min(n, LOGPROB_CHUNK) * cols * 4 * 2
    return int(stored * ACTIVATION_SLACK[engine]) + gathered


# -- rollout servers --------------------------------------------------------------------------


def server_weight_bytes(config: Mapping[str, Any] | ModelShape, allocation: Allocation, dtype: str = "bfloat16") -> int:
    """Weights per GPU of one sglang/vllm instance (``t * p`` GPUs), on its fullest GPU: layers
    split evenly over the pipeline stages, every matrix (embedding, head and experts too)
    over the tensor ranks. The server fills the rest of the GPU with its KV cache (its memory
    fraction) and CUDA graphs."""
    m = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    d = allocation.dims
    per = _ceil(m.layers, d.pp)
    worst = 0
    for s in range(d.pp):
        layers = range(s * per, min(m.layers, (s + 1) * per))
        params = stage_params(m, "actor", layers, first=s == 0, last=s == d.pp - 1, tp_vocab=True)
        split = sum(p.numel // d.tp if p.tp_dim is not None or p.expert else p.numel for p in params)
        worst = max(worst, split)
    return worst * DTYPE_BYTES[dtype]


# -- a layout that fits -----------------------------------------------------------------------


def candidates(engine: str, gpus: int, m: ModelShape) -> list[Allocation]:
    """Layouts of ``engine`` over exactly ``gpus`` GPUs, most data-parallel first (they cost
    the least communication), each one the engine runs for this model."""
    out: list[tuple[tuple[int, ...], Allocation]] = []
    divisors = [k for k in range(1, gpus + 1) if gpus % k == 0]
    pps = divisors if engine != "fsdp" else [1]
    eps = [1] + [e for e in divisors if e > 1 and m.is_moe and m.experts % e == 0] if engine != "fsdp" else [1]
    for tp in divisors:
        for pp in pps:
            if gpus % (tp * pp) or pp > m.layers:
                continue
            for ep in eps:
                try:
                    alloc = Allocation(engine, ParallelDims(dp=gpus // (tp * pp), tp=tp, pp=pp, ep=ep))
                    check_layout(m, engine, alloc.dims)
                    if pp > 1 and engine == "megatron" and m.layers % pp:
                        continue
                except (ValueError, MemoryInputError):
                    continue
                out.append(((tp * pp, -ep, pp), alloc))
    return [a for _, a in sorted(out, key=lambda x: x[0])]


def fitting_layout(
    config: Mapping[str, Any] | ModelShape,
    allocation: Allocation,
    limit_bytes: int,
    *,
    tokens: int,
    dtype: str = "bfloat16",
    role: str = "actor",
    recompute: bool = False,
    max_gpus: int = 1024,
) -> tuple[Allocation, MemoryPlan] | None:
    """The first layout of the same engine that fits in ``limit_bytes`` per GPU: the same GPU
    count sliced differently, then twice, four times ... the GPUs (None: none up to
    ``max_gpus``)."""
    m = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    gpus = allocation.world_size
    while gpus <= max_gpus:
        for alloc in candidates(allocation.backend, gpus, m):
            plan = estimate(m, alloc, tokens=tokens, dtype=dtype, role=role, recompute=recompute)
            if plan.largest.total <= limit_bytes:
                return alloc, plan
        gpus *= 2
    return None


def gib(n: int) -> str:
    return f"{n / GIB:.1f}"
