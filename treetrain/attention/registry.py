"""The attention backends, keyed by the config's attention names (``actor.treeTraining.attention``).

:func:`resolve` is pure: it reads no environment. ``TREETRAIN_ATTENTION`` is read where a run
starts (the trainer config's loader, and :func:`treetrain.tree_logprobs`), never here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

import torch

from treetrain.attention.dense import dense_attention
from treetrain.attention.flex import flex_attention
from treetrain.attention.meta import TreeAttentionMeta
from treetrain.attention.sparse import sparse_attention
from treetrain.attention.triton_tree import TritonUnavailableError, check_available, triton_attention
from treetrain.config.schema import AttentionName

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, TreeAttentionMeta, float], torch.Tensor]

BACKENDS: dict[str, AttentionFn] = {
    "dense": dense_attention,
    "sparse": sparse_attention,
    "flex": flex_attention,
    "triton": triton_attention,
}
# One list of names: the config's ``AttentionName`` ("auto" plus every backend).
NAMES: tuple[str, ...] = get_args(AttentionName)
assert set(NAMES) == {"auto", *BACKENDS}, (NAMES, tuple(BACKENDS))


class UnknownBackendError(ValueError):
    """An attention name that is not a backend; the message lists the valid ones."""


class BackendUnavailableError(ValueError):
    """A valid backend that cannot run here (device, gradients, missing package)."""


def resolve(name: str, device: torch.device | None = None, *, needs_grad: bool = False) -> str:
    """The concrete backend for ``name`` on ``device``. ``auto`` picks ``flex`` on CUDA
    (fused, forward and backward) and ``sparse`` elsewhere (the portable block-sparse path,
    with autograd). An explicit choice that cannot work here fails now, with the reason,
    instead of deep inside a forward pass. Pure: no environment is read."""
    on_cuda = device is not None and device.type == "cuda"
    if name == "auto":
        return "flex" if on_cuda else "sparse"
    if name not in BACKENDS:
        raise UnknownBackendError(f"unknown attention backend {name!r}; valid: {', '.join(NAMES)}")
    if device is not None and not on_cuda:
        if name == "flex" and needs_grad:
            raise BackendUnavailableError(
                f"attention='flex' has no backward on {device.type}; train with 'sparse' (or 'auto') here, "
                "and use 'flex' on CPU only for forward passes under torch.no_grad()"
            )
        if name == "triton":
            try:
                check_available(device)
            except TritonUnavailableError as err:
                raise BackendUnavailableError(str(err)) from None
    return name


def get(name: str) -> AttentionFn:
    """The attention function of a concrete backend name."""
    try:
        return BACKENDS[name]
    except KeyError:
        resolve(name)  # raises the right message
        raise
