"""LoRA on the FSDP engine's Hugging Face model: an adapter on each targeted projection of
every decoder layer (:func:`treetrain.engines.lora.linear.attach`), after tensor parallel and
before FSDP2, the base frozen. The adapted modules keep their Hugging Face names
(``model.layers.0.self_attn.q_proj``), which are the adapter's names in a PEFT directory too.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from treetrain.alloc.lora import ATTENTION_TARGETS, ROW_PARALLEL
from treetrain.config.lora import LoraSettings
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.lora.linear import attach, freeze_base


def _where(target: str) -> str:
    return f"self_attn.{target}" if target in ATTENTION_TARGETS else f"mlp.{target}"


def adapted_modules(model: nn.Module, targets: tuple[str, ...]) -> dict[str, nn.Module]:
    """Each targeted projection of every decoder layer by its full module name. A layer
    without one (a mixture-of-experts layer's FFN: transformers fuses its experts) is refused."""
    from treetrain.engines.fsdp.parallelize import decoder_layers

    layers = decoder_layers(model)
    prefix = next(name for name, module in model.named_modules() if module is layers)
    found: dict[str, nn.Module] = {}
    for i, layer in enumerate(layers):
        for target in targets:
            try:
                module = layer.get_submodule(_where(target))
            except AttributeError:
                raise EngineConfigError(
                    f"actor.lora: layer {i} has no {_where(target)} (a mixture-of-experts FFN?); the fsdp engine "
                    "adapts attention and dense FFNs only; fix: use archon or megatron for adapters on experts, or "
                    f"targetModules: [{', '.join(ATTENTION_TARGETS)}]"
                ) from None
            found[f"{prefix}.{i}.{_where(target)}"] = module
    return found


def apply_lora(model: nn.Module, lora: LoraSettings, targets: tuple[str, ...], tp: DeviceMesh | None) -> None:
    """Attach the adapters (zero until the engine loads them) and freeze the base. Under tensor
    parallel (``tp``), column-parallel projections keep their output split by features
    (``Shard(-1)``), row-parallel ones reduce to a replicated output, as their styles do."""
    for name, module in adapted_modules(model, targets).items():
        target = name.rsplit(".", 1)[-1]
        row = target in ROW_PARALLEL
        attach(
            module,
            lora.rank,
            scale=lora.scale,
            dropout=lora.dropout,
            split=None if tp is None else ("row" if row else "column"),
            mesh=tp,
            out_placements=(Replicate(),) if row else (Shard(-1),),
        )
    freeze_base(model)
