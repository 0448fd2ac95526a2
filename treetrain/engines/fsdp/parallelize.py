"""How a model is spread over the ranks: tensor parallel (DTensor), then FSDP2 (``fully_shard``).

Precision: with ``d > 1`` and a 16-bit ``model.dtype``, parameters are stored (and optimized)
in fp32 and FSDP2's :class:`MixedPrecisionPolicy` casts them to the 16-bit dtype when it
gathers them for the forward and backward passes, and reduces gradients in fp32: fp32
master weights. With ``d = 1`` nothing is ``fully_shard``-ed, so there is no FSDP cast: the
model is built directly in the 16-bit dtype and AdamW updates 16-bit weights (see
:func:`param_dtype`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from treetrain.config import ModelSettings
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.parallel import ParallelLayout


def compute_dtype(settings: ModelSettings) -> torch.dtype:
    """``model.dtype`` as a torch dtype: what the forward and backward passes run in."""
    dtype: torch.dtype = getattr(torch, settings.dtype)
    return dtype


def param_dtype(settings: ModelSettings, layout: ParallelLayout) -> torch.dtype:
    """The dtype parameters are built, stored and optimized in: fp32 under FSDP mixed
    precision (``d > 1`` and a 16-bit ``model.dtype``), else the compute dtype."""
    return torch.float32 if mixed_precision(settings, layout) is not None else compute_dtype(settings)


def mixed_precision(settings: ModelSettings, layout: ParallelLayout) -> MixedPrecisionPolicy | None:
    """FSDP2's policy (16-bit compute, fp32 gradient reduction), or None (fp32, or ``d = 1``)."""
    if settings.dtype == "float32" or layout.dp == 1:
        return None
    return MixedPrecisionPolicy(param_dtype=compute_dtype(settings), reduce_dtype=torch.float32)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList):
            return module
    raise EngineConfigError(f"{type(model).__name__} has no decoder `layers` list; the FSDP engine cannot shard it")


def parallelize(model: nn.Module, layout: ParallelLayout, settings: ModelSettings) -> nn.Module:
    """Apply the parallel strategy in place, in this order:

    1. Tensor parallel (``t > 1``): shard attention and MLP projections with DTensor. It goes
       first because FSDP then shards the already tensor-parallel parameters over the
       data-parallel dimension (2-D), not the other way round.
    2. FSDP2 (``d > 1``): one ``fully_shard`` per decoder layer, so each layer's parameters
       are gathered just before it runs and freed after; then the root for the rest
       (embeddings, final norm, head). With ``d = 1`` nothing is sharded.
    """
    if layout.mesh is None:
        return model
    if layout.tp > 1:
        apply_tp(model, layout.mesh["tp"])
    if layout.dp > 1:
        apply_fsdp(model, layout.mesh["dp"], mixed_precision(settings, layout))
    return model


def apply_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Column-parallel q/k/v and gate/up leave each rank its own heads / MLP slice; the
    row-parallel o/down projections all-reduce back to a replicated hidden state, so the
    norms, embeddings and head stay plain replicated modules."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    config: Any = model.config
    tp = mesh.size()
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    if heads % tp or kv_heads % tp or config.intermediate_size % tp:
        sizes = [t for t in range(1, kv_heads + 1) if not (heads % t or kv_heads % t or config.intermediate_size % t)]
        raise EngineConfigError(
            f"t{tp} must divide the attention heads ({heads}), key/value heads ({kv_heads}) "
            f"and MLP width ({config.intermediate_size}) of the model; fix: t in {{{', '.join(map(str, sizes))}}}"
        )
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in decoder_layers(model):
        try:
            for name in plan:
                layer.get_submodule(name)
        except AttributeError as err:
            raise EngineConfigError(f"tensor parallel expects Llama-style decoder layers: {err}") from None
        layer_plan = dict(plan)
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            if _has(layer, norm):
                # Qwen3's per-head norms see only this rank's heads ([b, s, H/t, D]): replicated
                # weights over head-sharded inputs, so their gradients are summed over the
                # tensor ranks (as plain tensors each rank would step its heads' part alone).
                layer_plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(layer, mesh, layer_plan)


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """FSDP2 over ``mesh``: each decoder layer, then the root; ``mp_policy`` from :func:`mixed_precision`."""
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
