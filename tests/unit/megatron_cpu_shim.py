"""A test-only stand-in for the CUDA calls megatron-core 0.16.1 makes on its MoE path, so
that MoE layers run on CPU processes: the router moves its weights to
``torch.cuda.current_device()``, and ``moe_utils`` names ``te_general_gemm`` only when
TransformerEngine imports. (Sequence parallel's CUDA-only calls are the engine's own CPU
adapter, ``parallel.cpu_sequence_parallel``, applied for ``t > 1`` on CPU.) Applied only when
CUDA is unavailable; the engine has no branch for it. Tests that need it call :func:`apply`
(in each process) and say so."""

from __future__ import annotations

import torch


def apply() -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
