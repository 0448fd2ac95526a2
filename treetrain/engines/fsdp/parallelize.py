"""How a model is spread over the ranks: tensor parallel (DTensor), then FSDP2 (``fully_shard``).

Precision (one rule for every engine, :mod:`treetrain.alloc.precision`): parameters are
stored and optimized in fp32. With a 16-bit ``model.dtype`` FSDP2's
:class:`MixedPrecisionPolicy` casts each layer to it when it gathers the layer for the forward
and backward passes and reduces gradients in fp32: fp32 master weights. FSDP2 wraps the
model whenever it shards (``d > 1``) or casts (16-bit compute), over a one-rank data mesh when
``d = 1``, so every ``d`` runs the same code and the same numerics (why FSDP2 does the
cast: :mod:`treetrain.engines.precision`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from treetrain.alloc.precision import Precision
from treetrain.config.lora import LoraSettings
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.fsdp.layout import FSDPLayout
from treetrain.engines.layout import one_rank_mesh
from treetrain.engines.precision import mixed_precision


def data_mesh(layout: FSDPLayout) -> DeviceMesh:
    """The data-parallel mesh FSDP2 wraps the model over (one rank: a one-rank mesh)."""
    return layout.mesh["dp"] if layout.mesh is not None else one_rank_mesh(layout.device, "dp")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList):
            return module
    raise EngineConfigError(f"{type(model).__name__} has no decoder `layers` list; the FSDP engine cannot shard it")


def parallelize(
    model: nn.Module,
    layout: FSDPLayout,
    prec: Precision,
    lora: LoraSettings | None = None,
    targets: tuple[str, ...] = (),
) -> nn.Module:
    """Apply the parallel strategy in place, in this order:

    1. Tensor parallel (``t > 1``): shard attention and MLP projections with DTensor. It goes
       first because FSDP then shards the already tensor-parallel parameters over the
       data-parallel dimension (2-D), not the other way round.
    2. FSDP2 (when ``prec.fsdp``: ``d > 1`` or 16-bit compute): one ``fully_shard`` per
       decoder layer, so each layer's parameters are gathered (and cast) just before it runs
       and freed after; then the root for the rest (embeddings, final norm, head). With
       ``d = 1`` and fp32 nothing is wrapped.

    ``lora``: adapters on ``targets`` between the two (:mod:`.lora`), the base frozen.
    """
    if layout.tp > 1:
        assert layout.mesh is not None
        apply_tp(model, layout.mesh["tp"])
    if lora is not None:
        from treetrain.engines.fsdp.lora import apply_lora

        apply_lora(model, lora, targets, layout.mesh["tp"] if layout.tp > 1 and layout.mesh is not None else None)
    if prec.fsdp:
        apply_fsdp(model, data_mesh(layout), mixed_precision(prec))
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


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    """FSDP2 over ``mesh``: each decoder layer, then the root; ``mp_policy`` from :func:`mixed_precision`."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
