"""The FSDP engine's model spread over its ranks: one role's Hugging Face model
(:func:`treetrain.engines.hf_model.build_model`) tensor-parallel and FSDP2-wrapped
(:func:`build_parallel`), loaded sharded when there are several ranks (:func:`load_sharded`,
weights read by rank 0 only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from treetrain.alloc.precision import Precision
from treetrain.config.lora import LoraSettings
from treetrain.engines.fsdp.layout import FSDPLayout
from treetrain.engines.fsdp.parallelize import parallelize
from treetrain.engines.hf_model import build_model
from treetrain.engines.precision import torch_dtype
from treetrain.engines.source import ModelSource

LoRA = tuple[LoraSettings, tuple[str, ...]] | None  # an adapter's settings and targets


def load_sharded(source: ModelSource, role: str, layout: FSDPLayout, prec: Precision, lora: LoRA = None) -> nn.Module:
    """Several ranks, weights from a directory: build on the meta device, shard, then load.

    Only rank 0 reads the checkpoint (one full copy in host memory, not one per rank); every
    rank builds the model on the meta device (no memory), shards it, allocates just its
    shards (``to_empty``) and receives them from rank 0. Buffers that are not in the state
    dict (rotary frequencies) are broadcast from rank 0 too.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    dtype = torch_dtype(prec.params)
    full_model = build_model(source, role, dtype=dtype) if layout.is_main else None
    model = parallelize(build_model(source, role, meta=True, dtype=dtype), layout, prec, *(lora or (None, ())))
    model.to_empty(device=layout.device)
    full = full_model.state_dict() if full_model is not None else {}
    # The adapter is not in the checkpoint: the engine loads it next.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=lora is None)
    set_model_state_dict(model, full, options=options)
    src_buffers = dict(full_model.named_buffers()) if full_model is not None else {}
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if full_model is not None:
                buf.copy_(src_buffers[name])
            dist.broadcast(buf, src=0)
    del full_model, full
    return model


def build_parallel(source: ModelSource, role: str, layout: FSDPLayout, prec: Precision, lora: LoRA = None) -> nn.Module:
    """One role's model spread over ``layout``, on ``layout.device``, identical on every rank;
    parameters in ``prec.params`` (the precision rule). ``lora``: the settings and targets of
    an adapter (attached with zeros, the base frozen; the engine loads its values)."""
    if layout.world_size > 1 and source.directory is not None:
        return load_sharded(source, role, layout, prec, lora)
    model = build_model(source, role, dtype=torch_dtype(prec.params))
    return parallelize(model, layout, prec, *(lora or (None, ()))).to(layout.device)
