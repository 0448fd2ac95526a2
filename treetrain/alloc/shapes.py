"""A model's parameter tensors from its Hugging Face config, and how each engine slices them.

Plain Python, no torch. :class:`ModelShape` reads a Llama / Qwen2 / Qwen3 (-MoE) config;
:func:`stage_params` lists every parameter tensor a pipeline stage holds; :func:`local_numel`
slices one the way an engine does (tensor, expert and FSDP sharding); :func:`stage_split` is
the pipeline split each engine runs (Archon's calls :func:`split_min_max`); :func:`check_layout`
is the engines' own refusals that change the count. The memory plan (:mod:`.memory`) counts
bytes from these.

Letters: h hidden size, I FFN width, V vocabulary, H query heads, K key/value heads, D head
dim, E experts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetrain.alloc.model import FIELD_NAME, LETTER_FIELD, ParallelDims
from treetrain.alloc.registry import spec_of

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


class MemoryInputError(ValueError):
    """A model config or layout the estimator cannot read, with the fix (``field``: the config
    key at fault, dotted from the trainer config's top, where it is not the layout)."""

    def __init__(self, message: str, fix: str, field: str = "") -> None:
        self.message, self.fix, self.field = message, fix, field
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
    width that expert tensor parallel splits, the other the model width that FSDP shards;
    ``fsdp_dim``: the dimension FSDP shards instead, where an engine says so, as for a LoRA
    expert adapter)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    expert: bool = False
    ffn_dim: int = 1
    fsdp_dim: int | None = None

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


# -- the balanced pipeline split (stage_split "balanced"; archon/pipeline.py runs it) ----------


def layer_flops(m: ModelShape, tokens: int) -> list[float]:
    """Forward FLOPs per layer on a tree of ``tokens`` tokens (attention at a full causal mask)."""
    d, hd = m.hidden, m.heads * m.head_dim
    proj = 2 * d * (hd + 2 * m.kv_heads * m.head_dim) + 2 * hd * d
    attention = 2 * hd * (tokens + 1)  # q.k and p.v, each query over (tokens + 1) / 2 keys on average
    dense = 6 * d * m.ffn
    moe = 2 * d * m.experts + m.top_k * 6 * d * m.moe_ffn
    return [float(tokens * (proj + attention + (moe if i in m.moe_layers else dense))) for i in range(m.layers)]


def head_flops(m: ModelShape, tokens: int, *, value_head: bool) -> float:
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
    """Which layers each pipeline stage holds, by the engine's ``stage_split``: ``balanced``
    minimises the costliest stage's FLOPs (Archon), ``even`` gives every stage ``layers / p``
    (Megatron)."""
    if spec_of(engine).stage_split == "balanced":
        costs = layer_flops(m, tokens)
        return split_min_max(costs, pp, last=head_flops(m, tokens, value_head=role == "critic"))
    _check_even_split(m, pp)
    each = m.layers // pp
    return [range(s * each, (s + 1) * each) for s in range(pp)]


def _check_even_split(m: ModelShape, pp: int) -> None:
    if m.layers % pp:
        fits = [p for p in range(1, m.layers + 1) if m.layers % p == 0]
        raise MemoryInputError(
            f"{m.layers} layers do not split over p{pp}", f"p in {{{', '.join(map(str, fits[:12]))}}}"
        )


# -- slicing ----------------------------------------------------------------------------------


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def local_numel(p: Param, engine: str, dims: ParallelDims) -> int:
    """Elements of ``p`` on the rank that holds the most of it.

    Tensor parallel divides ``tp_dim``; experts split over ``ep`` by expert and over ``etp``
    by FFN width. FSDP2 (the engine's ``shards_over``: fsdp ``d``, archon ``d*c``) then shards
    dim 0 of a tensor over those ranks, or, when experts are sharded, an expert tensor's model
    width over the expert-data ranks, in ``torch.chunk`` pieces (the first ranks get the
    rounded-up share). An engine that shards over nothing (Megatron) replicates parameters
    over data ranks (its ZeRO-1 shards only the optimizer)."""
    shape = list(p.shape)
    if p.expert:
        shape[0] //= dims.ep
        shape[p.ffn_dim] //= dims.etp
    elif p.tp_dim is not None:
        shape[p.tp_dim] //= dims.tp
    group = spec_of(engine).shard_size(dims)
    if group > 1:
        if p.expert and dims.ep * dims.etp > 1:
            width = 3 - p.ffn_dim if p.fsdp_dim is None else p.fsdp_dim  # w1/w3 [E, I, h]: h is dim 2; w2: 1
            shape[width] = ceil_div(shape[width], dims.edp)
        else:
            shape[0] = ceil_div(shape[0], group)
    return math.prod(shape)


def check_layout(m: ModelShape, engine: str, dims: ParallelDims) -> None:
    """The engines' own refusals that change the count (from the engine's description): letters
    it does not run yet, tensor parallel on experts, what t, e and ffn t must divide, and the
    layers an even pipeline split needs."""
    spec = spec_of(engine)
    t = dims.tp
    for letter, why in spec.letters.not_yet.items():
        if getattr(dims, LETTER_FIELD[letter]) > 1:
            raise MemoryInputError(
                f"{why} ({FIELD_NAME[LETTER_FIELD[letter]]}, {letter})", f"drop {letter} and raise d or t"
            )
    if not spec.moe_tensor_parallel and m.is_moe and t > 1:
        raise MemoryInputError(
            f"the {engine} engine has no tensor parallel on a mixture-of-experts model", "shard experts with e, raise d"
        )
    sizes = {"attention heads": m.heads, "key/value heads": m.kv_heads, "FFN width": m.ffn}
    if spec.vocab_parallel:
        sizes["vocabulary"] = m.vocab
    for what, n in sizes.items():
        if n % t:
            fits = [k for k in range(1, m.kv_heads + 1) if all(v % k == 0 for v in sizes.values())]
            raise MemoryInputError(f"t{t} does not divide the {what} ({n})", f"t in {{{', '.join(map(str, fits))}}}")
    if dims.pp > 1 and spec.stage_split == "even":
        _check_even_split(m, dims.pp)
    if dims.ep > 1 or dims.etp > 1:
        if not m.is_moe:
            raise MemoryInputError(f"e{dims.ep} shards experts, but this model has none", "drop e")
        if m.experts % dims.ep:
            fits = [k for k in range(1, m.experts + 1) if m.experts % k == 0]
            raise MemoryInputError(f"e{dims.ep} does not divide the {m.experts} experts", f"e in {set(fits)}")
        if m.moe_ffn % dims.etp:
            raise MemoryInputError(f"ffn t{dims.etp} does not divide the expert FFN width ({m.moe_ffn})", "pick ffn t")
