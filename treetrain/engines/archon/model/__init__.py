"""The Archon models: ``ModelArgs`` from a Hugging Face config, the ``Transformer``, and the
weight adapter between Hugging Face checkpoints and it."""

from treetrain.engines.archon.model.args import FAMILIES, ModelArgs
from treetrain.engines.archon.model.model import (
    Attention,
    FeedForward,
    GroupedExperts,
    MoE,
    RMSNorm,
    Transformer,
    TransformerBlock,
    TreeAttention,
)

__all__ = [
    "FAMILIES",
    "Attention",
    "FeedForward",
    "GroupedExperts",
    "MoE",
    "ModelArgs",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "TreeAttention",
]
