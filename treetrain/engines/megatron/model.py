"""A megatron-core ``GPTModel`` that runs packed trees: tree attention as Megatron's core
attention, RoPE at tree positions (Megatron's config from a Hugging Face config is
:mod:`.config`).

Letters: N tree tokens of this rank (all of the tree, or a context-parallel chunk), H query
heads, K key/value heads, D head dim, h hidden size.

The tree reaches every layer as ``GPTModel.forward(attention_mask=...)``: Megatron hands that
argument to core attention untouched, so a :class:`TreeInput` (the compact ``token_end``
metadata, one int per token; never an N x N mask) travels there, and recomputation replays it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from treetrain.attention import TreeAttentionMeta, get
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.megatron.config import (
    rope_inv_freq,
    transformer_config,
)
from treetrain.engines.zero import reduce_scatter_sum

with warnings.catch_warnings():
    # megatron-core warns at import time that TransformerEngine and Apex are missing (CPU, tests).
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig


@contextlib.contextmanager
def megatron_quiet() -> Iterator[None]:
    """megatron-core warns about its environment (no TransformerEngine/Apex, CUDA settings) on
    every build and some forwards; none of it concerns this engine's CPU-capable path."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"megatron\.")
        yield


@dataclass(eq=False)
class TreeInput:
    """What a tree forward hands every layer: the whole tree's mask metadata and the query
    rows this rank computes (``[row_start, row_start + rows)``: all of them, or this context
    parallel rank's chunk)."""

    meta: TreeAttentionMeta
    positions_N: torch.Tensor  # tree depth of this rank's tokens (RoPE)
    padding_N: torch.Tensor  # bool, this rank's padding tokens (never routed to experts)
    row_start: int = 0


# -- layer specs ------------------------------------------------------------------------------


class TreeRMSNorm(nn.Module):
    """RMSNorm for Megatron's local spec (any of its norms: before attention and MLP, q/k,
    final). Megatron's torch-norm wrapper refuses sequence parallel; this one runs on whatever
    rows it gets and marks its weight ``sequence_parallel`` when the config is, so that the
    engine sums its gradient over the tensor ranks (each saw ``1/t`` of the tokens), as
    Megatron does for TransformerEngine's norms."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def transformer_engine_available() -> bool:
    """Whether TransformerEngine imports (a CUDA install: its layer spec is then used)."""
    try:
        import transformer_engine  # type: ignore[import-not-found]  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install failing at import
        return False
    return True


def layer_spec(config: TransformerConfig, *, te: bool) -> ModuleSpec | TransformerBlockSubmodules:
    """Megatron's layer spec with tree core attention. ``te``: TransformerEngine's (norms
    fused into the next linear, its own sequence-parallel norms); otherwise the local spec
    with :class:`TreeRMSNorm` for every norm, the final one included (it is named by the block,
    not the layer: hence whole-block submodules)."""
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm
        )
        spec.submodules.self_attention.submodules.core_attention = TreeCoreAttention
        return spec
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        normalization="RMSNorm",
    )
    layer = spec.submodules
    attention = layer.self_attention.submodules
    attention.core_attention = TreeCoreAttention
    layer.input_layernorm = layer.pre_mlp_layernorm = TreeRMSNorm
    if config.qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = TreeRMSNorm
    n = get_num_layers_to_build(config, pp_rank=ps.get_pipeline_model_parallel_rank())
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=TreeRMSNorm)


# -- tree pieces ------------------------------------------------------------------------------


class TreeRotary(RotaryEmbedding):  # type: ignore[misc]  # megatron is untyped
    """RoPE at tree positions: Megatron's ``GPTModel`` asks for positions ``0..S-1`` and
    ignores ``position_ids``; on a packed tree every branch after the first would get flat
    positions. This table is indexed by each token's depth (set per forward by
    :class:`TreeGPT`). No ``lru_cache``: the table changes with every tree."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        dim = 2 * inv_freq.shape[0]
        super().__init__(kv_channels=dim, rotary_percent=1.0, use_cpu_initialization=True)
        self.inv_freq = inv_freq
        self.positions_N: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.positions_N is not None, "TreeGPT sets the positions before each forward"
        pos = self.positions_N
        freqs_ND = pos.to(torch.float32)[:, None] * self.inv_freq.to(pos.device)[None, :]
        return torch.cat((freqs_ND, freqs_ND), dim=-1)[:, None, None, :]  # [N, 1, 1, D]


class TreeCoreAttention(nn.Module):
    """Megatron core attention over a packed tree: ``query [N, 1, H, D]`` (RoPE applied),
    ``key/value [N, 1, K, D]`` -> ``[N, 1, H * D]``, with the mask from ``attention_mask``
    (a :class:`TreeInput`). Under context parallel, K and V of the whole tree are gathered
    in one collective (the tree mask holds for any split of the query rows)."""

    def __init__(self, config: TransformerConfig, softmax_scale: float | None = None, **_: Any) -> None:
        super().__init__()
        self.config = config
        d = config.kv_channels
        assert d is not None
        self.scale = softmax_scale if softmax_scale is not None else d**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if not isinstance(attention_mask, TreeInput):
            raise ValueError("tree core attention needs a TreeInput as attention_mask (call TreeGPT, not GPTModel)")
        if query.shape[1] != 1 or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("tree core attention takes one packed tree (batch 1), no bias, no packed_seq_params")
        tree = attention_mask
        n = query.shape[0]
        q_HND = query[:, 0].transpose(0, 1)
        kv_2KND = torch.stack((key[:, 0], value[:, 0])).transpose(1, 2)
        cp = ps.get_context_parallel_world_size()
        if cp > 1:
            # One autograd collective for K and V together (two separate ones gave wrong gradients).
            kv_2KND = _GatherRows.apply(kv_2KND.contiguous(), ps.get_context_parallel_group())
        out_HND = tree_rows(q_HND, kv_2KND[0], kv_2KND[1], tree, self.scale)
        return out_HND.transpose(0, 1).reshape(n, 1, -1)


class _GatherRows(torch.autograd.Function):
    """Every context rank's rows (dim 2) concatenated in rank order; the backward sums each
    rank's slice of the gradient over the ranks (:func:`treetrain.engines.zero.reduce_scatter_sum`).
    Not torch's ``torch.distributed.nn.all_gather``: on gloo its backward scatters from group
    ranks as if they were global ones, which fails on any group without rank 0 (``d2c2``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size = dist.get_world_size(ctx.group)
        flat = torch.cat([part.reshape(-1) for part in grad.chunk(size, dim=2)])
        out = torch.empty(flat.numel() // size, dtype=grad.dtype, device=grad.device)
        reduce_scatter_sum(out, flat, ctx.group)
        shape = list(grad.shape)
        shape[2] //= size
        return out.view(shape), None


def tree_rows(
    q_HND: torch.Tensor, k_KTD: torch.Tensor, v_KTD: torch.Tensor, tree: TreeInput, scale: float
) -> torch.Tensor:
    """Tree attention for query rows ``[row_start, row_start + N)`` over the keys of the whole
    tree. Keys after the last query row are never visible (``j <= i``), so the rows are
    computed as the prefix tree ``[0, end)``, ``end`` the first block boundary at or after
    the last row, with the other query rows left zero (exact; a context-parallel rank with
    late rows pays for the earlier rows' attention)."""
    fn = get(tree.meta.backend)
    h, n, d = q_HND.shape
    if tree.row_start == 0 and n == tree.meta.num_tokens:
        return fn(q_HND, k_KTD, v_KTD, tree.meta, scale)
    b = tree.meta.block_size
    end = -(-(tree.row_start + n) // b) * b
    before = q_HND.new_zeros(h, tree.row_start, d)
    after = q_HND.new_zeros(h, end - tree.row_start - n, d)
    q_HED = torch.cat((before, q_HND, after), dim=1)
    out = fn(q_HED, k_KTD[:, :end], v_KTD[:, :end], prefix_meta(tree.meta, end), scale)
    return out[:, tree.row_start : tree.row_start + n]


def prefix_meta(meta: TreeAttentionMeta, end: int) -> TreeAttentionMeta:
    """The metadata of tokens ``[0, end)`` of a tree (subtrees cut at ``end``)."""
    cache = meta.__dict__.setdefault("_prefixes", {})
    if end not in cache:
        cache[end] = TreeAttentionMeta(
            backend=meta.backend, token_end_N=meta.token_end_N[:end].clamp(max=end), block_size=meta.block_size
        )
    found: TreeAttentionMeta = cache[end]
    return found


class ValueHead(nn.Module):
    """The critic's output layer (replaces the LM head): hidden ``[N, 1, h]`` -> ``[N, 1, 1]``.
    Under sequence parallel a rank holds ``N / t`` rows: they are all-gathered first, and the
    backward keeps this rank's rows of the (identical on every tensor rank) output gradient."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size))
        self.bias = nn.Parameter(torch.zeros(1))
        self.sequence_parallel = sequence_parallel
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's init

    def forward(self, hidden: torch.Tensor, weight: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight, self.bias), None


def full_recompute(model: GPTModel) -> None:
    """Recompute every transformer layer in backward (activation checkpointing, non-reentrant:
    Python arguments such as :class:`TreeInput` are replayed as they are, nothing is saved
    for them but the int64 ``token_end`` the metadata already holds)."""
    for layer in model.decoder.layers:
        inner = layer.forward

        def replay(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            with megatron_quiet():  # the replay runs in backward, outside TreeGPT.forward's
                return _inner(*args, **kwargs)

        def forward(*args: Any, _replay: Any = replay, **kwargs: Any) -> Any:
            return checkpoint(_replay, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


class TreeGPT(nn.Module):
    """One pipeline stage of a ``GPTModel`` (or the whole model) with tree attention and tree
    RoPE; the critic's has a value head instead of the LM head."""

    gpt: Any  # megatron's GPTModel (untyped)

    def __init__(
        self, hf: Any, *, role: str, recompute: bool, seed: int, te: bool = False, dispatcher: str = "allgather"
    ) -> None:
        super().__init__()
        with megatron_quiet():
            self._build(hf, role=role, recompute=recompute, seed=seed, te=te, dispatcher=dispatcher)

    def _build(self, hf: Any, *, role: str, recompute: bool, seed: int, te: bool, dispatcher: str) -> None:
        config = transformer_config(hf, recompute=recompute, dispatcher=dispatcher)
        tp = config.tensor_model_parallel_size
        if hf.vocab_size % tp:
            raise EngineConfigError(f"vocab_size {hf.vocab_size} does not split over t{tp}; pick t dividing it")
        if hf.num_key_value_heads % tp:
            raise EngineConfigError(
                f"{hf.num_key_value_heads} key/value heads do not split over t{tp}; pick t dividing them"
            )
        if hf.num_hidden_layers % config.pipeline_model_parallel_size:
            raise EngineConfigError(
                f"{hf.num_hidden_layers} layers do not split over p{config.pipeline_model_parallel_size}"
            )
        spec = layer_spec(config, te=te)
        self.config = config
        self.hf_config = copy.deepcopy(hf)
        self.role = role
        self.vocab_size = int(hf.vocab_size)
        self.pre_process = ps.is_pipeline_first_stage()
        self.post_process = ps.is_pipeline_last_stage()
        # Over several stages the engine keeps the tie itself (loads the head from the
        # embedding, sums their gradients): megatron's own setup copies weights via CUDA.
        tied = bool(getattr(hf, "tie_word_embeddings", False)) and role != "critic"
        tied = tied and config.pipeline_model_parallel_size == 1
        torch.manual_seed(seed)  # the value head: the same on every rank
        self.gpt = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=hf.vocab_size,
            max_sequence_length=hf.max_position_embeddings,
            pre_process=self.pre_process,
            post_process=self.post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
        )
        if hasattr(self.gpt, "rotary_pos_emb"):
            self.gpt.rotary_pos_emb = TreeRotary(rope_inv_freq(hf))
        if role == "critic" and self.post_process:
            self.gpt.output_layer = ValueHead(hf.hidden_size, sequence_parallel=config.sequence_parallel)
        if recompute:
            full_recompute(self.gpt)

    def set_input_tensor(self, hidden: torch.Tensor | None) -> None:
        self.gpt.set_input_tensor(hidden)

    def forward(self, input_ids_N: torch.Tensor | None, tree: TreeInput) -> torch.Tensor:
        """First stage: token ids in; other stages read :meth:`set_input_tensor`. Last stage:
        ``[N, V / t]`` logits (vocab-parallel) or ``[N]`` values; others ``[N, 1, h]`` hidden."""
        rope = getattr(self.gpt, "rotary_pos_emb", None)
        if isinstance(rope, TreeRotary):
            rope.positions_N = tree.positions_N
        ids = input_ids_N[None] if input_ids_N is not None else None
        pos = tree.positions_N[None] if ids is not None else None
        # MoE layers leave padding out of routing (and of any router loss).
        padding = tree.padding_N[None] if self.config.num_moe_experts else None
        if padding is not None and self.config.sequence_parallel and not self.pre_process:
            # GPTModel splits the padding over the tensor ranks only on the first stage.
            rows = padding.shape[1] // self.config.tensor_model_parallel_size
            padding = padding[:, ps.get_tensor_model_parallel_rank() * rows :][:, :rows]
        with megatron_quiet():
            out: torch.Tensor = self.gpt(input_ids=ids, position_ids=pos, attention_mask=tree, padding_mask=padding)
        if not self.post_process:
            return out
        return out[0, :, 0] if self.role == "critic" else out[0]
