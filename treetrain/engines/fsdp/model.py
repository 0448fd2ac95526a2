"""Building the FSDP engine's Hugging Face model from a resolved
:class:`~treetrain.engines.source.ModelSource`: :func:`build_model` (one role's model, on the CPU or the meta device)
and :func:`load_sharded` (several ranks, weights read by rank 0 only).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from treetrain.alloc.precision import Precision
from treetrain.attention import use_tree_attention
from treetrain.config import ModelSettings
from treetrain.engines.base import check_role
from treetrain.engines.fsdp.parallelize import parallelize
from treetrain.engines.parallel import ParallelLayout
from treetrain.engines.precision import compute_dtype, torch_dtype
from treetrain.engines.source import ModelSource


def hf_config(model: ModelSource | ModelSettings | str) -> Any:
    """The Hugging Face config of a model (resolving the path when it is not resolved yet)."""
    source = model if isinstance(model, ModelSource) else ModelSource.resolve(model)
    return source.config


class ValueModel(nn.Module):
    """A critic: a transformers backbone plus a scalar head (the HF classes stay untouched)."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        hidden_BND = self.backbone(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
        values_BN: torch.Tensor = self.value_head(hidden_BND).squeeze(-1)
        return values_BN


def build_model(
    source: ModelSource | ModelSettings | str,
    role: str = "actor",
    *,
    meta: bool = False,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The model of one role: loaded from the source's directory on the CPU, or (``meta=True``,
    and for random built-in models) built from its config alone; identical on every rank.

    ``dtype``: the parameters' dtype (default: ``model.dtype``, ``auto`` resolved for this
    machine; the engine passes the precision rule's, fp32: see :mod:`.parallelize`).
    """
    from transformers import AutoModel, AutoModelForCausalLM

    check_role(role)
    if not isinstance(source, ModelSource):
        source = ModelSource.resolve(source)
    settings = source.settings
    dtype = dtype if dtype is not None else compute_dtype(settings)
    torch.manual_seed(settings.seed)  # built-in random weights and the value head: the same on every rank
    config = copy.deepcopy(source.config)  # transformers writes into it (the attention implementation)
    # transformers' Auto classes are untyped: Any. A critic is the bare backbone plus a value head.
    auto: Any = AutoModel if role == "critic" else AutoModelForCausalLM
    with torch.device("meta") if meta else contextlib.nullcontext():
        if meta or source.directory is None:
            net: nn.Module = auto.from_config(config, dtype=dtype)
        else:
            net = auto.from_pretrained(source.directory, config=config, dtype=dtype)
        use_tree_attention(net)
        model = ValueModel(net, config.hidden_size).to(dtype) if role == "critic" else net
    if settings.gradient_checkpointing:
        target = model.backbone if isinstance(model, ValueModel) else model
        # Newer transformers call it activation checkpointing (the old name warns on every run).
        enable = getattr(target, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    return model


def load_sharded(source: ModelSource, role: str, layout: ParallelLayout, prec: Precision) -> nn.Module:
    """Several ranks, weights from a directory: build on the meta device, shard, then load.

    Only rank 0 reads the checkpoint (one full copy in host memory, not one per rank); every
    rank builds the model on the meta device (no memory), shards it, allocates just its
    shards (``to_empty``) and receives them from rank 0. Buffers that are not in the state
    dict (rotary frequencies) are broadcast from rank 0 too.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    dtype = torch_dtype(prec.params)
    full_model = build_model(source, role, dtype=dtype) if layout.is_main else None
    model = parallelize(build_model(source, role, meta=True, dtype=dtype), layout, prec)
    model.to_empty(device=layout.device)
    full = full_model.state_dict() if full_model is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    src_buffers = dict(full_model.named_buffers()) if full_model is not None else {}
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if full_model is not None:
                buf.copy_(src_buffers[name])
            dist.broadcast(buf, src=0)
    del full_model, full
    return model


def build_parallel(source: ModelSource, role: str, layout: ParallelLayout, prec: Precision) -> nn.Module:
    """One role's model spread over ``layout``, on ``layout.device``, identical on every rank;
    parameters in ``prec.params`` (the precision rule)."""
    if layout.world_size > 1 and source.directory is not None:
        return load_sharded(source, role, layout, prec)
    model = build_model(source, role, dtype=torch_dtype(prec.params))
    return parallelize(model, layout, prec).to(layout.device)
