"""Tree attention backends (``dense`` reference, ``sparse`` block-sparse, ``flex``
FlexAttention, ``triton`` fused kernels) and the HF hook-up."""

from treetrain.attention.dense import dense_attention
from treetrain.attention.hf import IMPLEMENTATION, register, tree_attention_forward, tree_forward, use_tree_attention
from treetrain.attention.meta import TreeAttentionMeta
from treetrain.attention.registry import (
    BACKENDS,
    NAMES,
    BackendUnavailableError,
    UnknownBackendError,
    get,
    resolve,
)
from treetrain.attention.sparse import sparse_attention

__all__ = [
    "BACKENDS",
    "IMPLEMENTATION",
    "NAMES",
    "BackendUnavailableError",
    "TreeAttentionMeta",
    "UnknownBackendError",
    "dense_attention",
    "get",
    "register",
    "resolve",
    "sparse_attention",
    "tree_attention_forward",
    "tree_forward",
    "use_tree_attention",
]
