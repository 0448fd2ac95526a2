"""Hugging Face models of every role from a resolved :class:`~treetrain.engines.source.ModelSource`:
:func:`build_model` (an actor's causal LM, or a critic's backbone with a value head,
:class:`ValueModel`), identical on every rank. The FSDP engine trains these, the Megatron and
Archon engines read a random built-in model's weights from one, and local rollout and the
proxy sample from one."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

from treetrain.attention import use_tree_attention
from treetrain.config import ModelSettings
from treetrain.engines.contract import check_role
from treetrain.engines.precision import compute_dtype
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
