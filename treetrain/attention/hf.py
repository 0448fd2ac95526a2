"""Hugging Face transformers integration through its public attention registries.

:func:`register` adds one attention implementation, ``"treetrain"``, to
``AttentionInterface`` and its mask function to ``AttentionMaskInterface`` (both
process-wide). Inside :func:`tree_forward` the mask function returns ``None``, so
transformers never builds a mask or guesses packed sequences from the depth position
ids; the attention function reads the tree from the ``tree_attention=`` keyword that the
caller passes to the model (it reaches every attention layer, and gradient-checkpoint
recomputation replays it). Outside a tree forward the implementation is exactly
transformers' ``sdpa``, so a model switched to ``"treetrain"`` still works normally.

Letters: H query heads, K key/value heads, N tokens, D head dim.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from treetrain.attention.meta import TreeAttentionMeta
from treetrain.attention.registry import get

IMPLEMENTATION = "treetrain"
_IN_TREE_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("treetrain_tree_forward", default=False)
# Keywords transformers passes that carry nothing the tree needs, with the values we accept.
_IGNORED = ("position_ids", "cache_position", "use_cache", "output_attentions", "is_causal")


@contextlib.contextmanager
def tree_forward() -> Iterator[None]:
    """Mark a model call as tree-packed: transformers' mask construction is skipped."""
    token = _IN_TREE_FORWARD.set(True)
    try:
        yield
    finally:
        _IN_TREE_FORWARD.reset(token)


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tree_attention: TreeAttentionMeta | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: ``query [1, H, N, D]`` -> ``[1, N, H, D]``."""
    if tree_attention is None:
        if _IN_TREE_FORWARD.get():
            raise ValueError("a tree forward needs tree_attention=TreeAttentionMeta(...) passed to the model")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    _refuse_unsupported(query, attention_mask, dropout, kwargs)
    if tree_attention.num_tokens != query.shape[2]:
        raise ValueError(f"tree metadata has {tree_attention.num_tokens} tokens but the query has {query.shape[2]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out_HND = get(tree_attention.backend)(query[0], key[0], value[0], tree_attention, scale)
    return out_HND.transpose(0, 1)[None], None


def _refuse_unsupported(
    query: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float, kwargs: dict[str, Any]
) -> None:
    if query.shape[0] != 1:
        raise ValueError(f"tree attention takes one packed tree per call (batch 1), got batch {query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("tree attention builds its own mask; call the model inside treetrain.attention.tree_forward()")
    if dropout:
        raise ValueError(f"tree attention does not support attention dropout (got {dropout}); set attention_dropout=0")
    bad = []
    for name, value in kwargs.items():
        if name in _IGNORED:
            if name == "output_attentions" and value:
                bad.append("output_attentions=True")
            continue
        if value is None or value is False:  # e.g. sliding_window=None, softcap=None
            continue
        bad.append(f"{name}={value!r}" if not isinstance(value, torch.Tensor) else name)
    if bad:
        raise ValueError(
            f"tree attention does not support: {', '.join(sorted(bad))} "
            "(no sliding window, soft-capping, sinks, attention outputs or KV cache)"
        )


def tree_mask(**kwargs: Any) -> Any:
    """The registered mask function: no mask in a tree forward, ``sdpa``'s mask otherwise."""
    if _IN_TREE_FORWARD.get():
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(**kwargs)


def register() -> str:
    """Register ``"treetrain"`` with transformers' attention and mask registries; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, tree_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, tree_mask)
    return IMPLEMENTATION


def use_tree_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the ``"treetrain"`` implementation (registering it first)."""
    register()
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: tree_logprobs needs a transformers model")
    if getattr(config, "_attn_implementation", None) != IMPLEMENTATION:
        model.set_attn_implementation(IMPLEMENTATION)  # type: ignore[operator]
