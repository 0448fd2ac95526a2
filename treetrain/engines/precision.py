"""The precision rule (:mod:`treetrain.alloc.precision`) in torch terms, for every engine:
dtype names as torch dtypes, and FSDP2's mixed-precision policy.

Why FSDP2 does the casting (fsdp and archon, every layout): it is exact (each layer's fp32
weights are cast once per pass, the backward's gradients cast back to fp32 before they are
reduced and accumulated), it is one code path for every ``d`` (a one-rank data mesh when
nothing is sharded, so a ``d1`` run has the numerics of a ``d8`` one), and the memory plan can
count it (fp32 parameters, gradients and moments, plus a gathered 16-bit layer). Autocast
would compute norms and residuals in fp32 (other activations than the plan counts), and
master copies beside 16-bit weights would accumulate gradients in 16 bits.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from treetrain.alloc.precision import Precision, resolve_dtype
from treetrain.config import ModelSettings


def torch_dtype(name: str) -> torch.dtype:
    """A resolved dtype name (``bfloat16``) as torch's dtype."""
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def compute_dtype(settings: ModelSettings) -> torch.dtype:
    """``model.dtype`` as a torch dtype, ``auto`` resolved for this machine (bfloat16 with
    CUDA, else float32): what the forward and backward passes run in."""
    return torch_dtype(resolve_dtype(settings.dtype, cuda=torch.cuda.is_available()))


def mixed_precision(prec: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy: compute in ``prec.compute`` over the stored fp32 parameters, gradients
    reduced (and accumulated) in fp32; FSDP2's default (no cast) when both are fp32."""
    if prec.compute == prec.params:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch_dtype(prec.compute), reduce_dtype=torch.float32)
