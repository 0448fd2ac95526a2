"""Memory per GPU of a training engine (or a rollout server's weights) before launch: the
public names of the memory plan, in one place.

Plain Python, no torch: the operator imports this to refuse a layout that cannot fit. The
work is split by job:

- :mod:`.shapes`: every parameter tensor of a model from its Hugging Face config, and how
  each engine slices it (tensor, pipeline, expert and FSDP sharding);
- :mod:`.precision`: the dtype each engine keeps its weights in (one rule, which the engines
  build from too) and ``model.dtype: auto``;
- :mod:`.activations`: the estimate of one micro-batch's activations (calibrated against CPU
  peaks of ``bench/tree_memory.py``, see docs/engines.md, "Memory plan");
- :mod:`.plan`: :func:`estimate`, the exact static bytes plus the activations, per stage;
- :mod:`.lora`: a LoRA adapter's tensors (:class:`LoraShape`, :func:`adapter_params`), which
  :func:`estimate` counts when given ``lora=``;
- :mod:`.advice`: what would fit instead (:func:`changes_that_fit`, :func:`fitting_layout`).
"""

from __future__ import annotations

from treetrain.alloc.activations import LOGPROB_CHUNK, activation_bytes, activation_slack
from treetrain.alloc.advice import (
    COMMON_GPU_GIB,
    DEFAULT_BLOCK_SIZE,
    FitChange,
    candidates,
    changes_that_fit,
    exceeds_common_gpus,
    fitting_layout,
)
from treetrain.alloc.lora import LoraShape, adapter_params
from treetrain.alloc.plan import GIB, ROLES, MemoryPlan, RankMemory, estimate, gib, plan_dtype, server_weight_bytes
from treetrain.alloc.precision import DTYPE_BYTES, Precision, precision, resolve_dtype
from treetrain.alloc.shapes import (
    FAMILIES,
    MemoryInputError,
    ModelShape,
    Param,
    check_layout,
    head_flops,
    layer_flops,
    layer_params,
    local_numel,
    read_config,
    split_min_max,
    stage_params,
    stage_split,
    total_params,
)

__all__ = [
    "COMMON_GPU_GIB",
    "DEFAULT_BLOCK_SIZE",
    "DTYPE_BYTES",
    "FAMILIES",
    "GIB",
    "LOGPROB_CHUNK",
    "ROLES",
    "FitChange",
    "LoraShape",
    "MemoryInputError",
    "MemoryPlan",
    "ModelShape",
    "Param",
    "Precision",
    "RankMemory",
    "activation_bytes",
    "activation_slack",
    "adapter_params",
    "candidates",
    "changes_that_fit",
    "check_layout",
    "estimate",
    "exceeds_common_gpus",
    "fitting_layout",
    "gib",
    "head_flops",
    "layer_flops",
    "layer_params",
    "local_numel",
    "plan_dtype",
    "precision",
    "read_config",
    "resolve_dtype",
    "server_weight_bytes",
    "split_min_max",
    "stage_params",
    "stage_split",
    "total_params",
]
