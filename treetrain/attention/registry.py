"""The attention backends, keyed by the ``TREETRAIN_ATTENTION`` names."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from treetrain.attention.dense import dense_attention
from treetrain.attention.meta import TreeAttentionMeta
from treetrain.attention.sparse import sparse_attention

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, TreeAttentionMeta, float], torch.Tensor]

BACKENDS: dict[str, AttentionFn] = {"dense": dense_attention, "sparse": sparse_attention}
# Names DESIGN.md reserves for backends that are not built yet.
PLANNED = ("flex", "triton")
NAMES = ("auto", *BACKENDS, *PLANNED)
DEFAULT_BLOCK_SIZE = 128


class UnknownBackendError(ValueError):
    """An attention name that is not a backend; the message lists the valid ones."""


def resolve(name: str, device: torch.device | None = None) -> str:
    """The concrete backend for ``name``. ``auto`` reads ``TREETRAIN_ATTENTION`` first."""
    if name == "auto":
        name = os.environ.get("TREETRAIN_ATTENTION", "auto") or "auto"
    if name == "auto":
        # `sparse` runs everywhere; fused GPU backends take over here once they exist.
        return "sparse"
    if name in BACKENDS:
        return name
    if name in PLANNED:
        raise UnknownBackendError(
            f"attention backend {name!r} is not available in this version; use one of: {', '.join(('auto', *BACKENDS))}"
        )
    raise UnknownBackendError(f"unknown attention backend {name!r}; valid: {', '.join(NAMES)}")


def get(name: str) -> AttentionFn:
    """The attention function of a concrete backend name."""
    try:
        return BACKENDS[name]
    except KeyError:
        resolve(name)  # raises the right message
        raise


def block_size() -> int:
    """``TREETRAIN_BLOCK_SIZE`` (default 128)."""
    raw = os.environ.get("TREETRAIN_BLOCK_SIZE", "")
    if not raw:
        return DEFAULT_BLOCK_SIZE
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TREETRAIN_BLOCK_SIZE must be a positive integer, got {raw!r}")
    return int(raw)
