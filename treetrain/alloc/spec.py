"""What one engine is, in plain data: the type of the descriptions in :mod:`.specs` that the
registry (:mod:`.registry`) lists.

Torch-free: the parser, the memory plan, config validation, the operator (its CEL rule and
messages) and the engine factory all read these fields, and none of them compares engine names.
A field says what an engine does ("shards each parameter over d and c"), never which engine it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from treetrain.alloc.model import ParallelDims

Kind = Literal["training", "inference"]
# How a trained engine computes in a 16-bit model.dtype (the precision rule, alloc/precision.py):
# "fsdp2_cast": fp32 weights that FSDP2 casts to the compute dtype layer by layer;
# "fp32_master": bfloat16 weights and gradients, an fp32 master copy in the optimizer (float16:
# fp32 weights under autocast).
SixteenBit = Literal["fsdp2_cast", "fp32_master"]
# How pipeline stages get their layers: "even" (layers / p each; p must divide the layers),
# "balanced" (contiguous ranges that minimise the costliest stage's FLOPs, shapes.split_min_max).
StageSplit = Literal["even", "balanced"]


@dataclass(frozen=True, slots=True)
class EngineLetters:
    """Which letters of a backend string an engine takes.

    ``accepted``: the letters a plain (non-hybrid) string may hold; the parser refuses any other.
    ``not_yet``: accepted letters the engine does not run yet -> why; config validation refuses
    them above size 1, with the reason and a string that would run. ``hybrid``: it takes the MoE
    form ``backend:(attn:...|ffn:...)``. ``built``: False for an engine not in this release
    (config validation refuses every string)."""

    accepted: str
    not_yet: Mapping[str, str] = field(default_factory=dict)
    hybrid: bool = False
    built: bool = True

    @property
    def runs(self) -> str:
        """The letters this engine runs today (plain strings)."""
        return "".join(letter for letter in self.accepted if letter not in self.not_yet)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine (a trainer or a rollout server), everything the torch-free layers know of it.

    ``name``: the backend prefix (``fsdp`` in ``fsdp:d4t2``). ``kind``: ``training`` engines run
    in trainer pods, ``inference`` ones are rollout servers. ``letters``: what its strings take.
    ``refusal_note``: said after a letter the parser refuses (``fsdp shards data, tensor and
    context only``). The rest is for training engines:

    - ``engine``: ``module:Class`` of the torch engine; the factory imports it on first use.
    - ``sixteen_bit``: how it computes in 16 bits (:data:`SixteenBit`, the precision rule).
    - ``shards_over``: the :class:`~treetrain.alloc.model.ParallelDims` fields FSDP2 shards each
      parameter over, and so averages gradients over (empty: parameters are whole on every data
      rank). An expert tensor is sharded over the expert-data ranks on its model width instead,
      when experts are sharded (``e`` or ffn ``t`` > 1).
    - ``vocab_parallel``: the embedding and the head are split by vocabulary over the tensor
      ranks (so ``t`` must divide the vocabulary, and each rank holds ``V / t`` logit columns).
    - ``sequence_parallel``: hidden-size activations are split over the tensor ranks too.
    - ``context_kv_whole``: under context parallel each rank keeps the K and V of the whole tree
      (all-gathered); otherwise heads are exchanged (Ulysses) and a rank keeps ``1 / c`` of them.
    - ``stage_split``: how pipeline stages get their layers (:data:`StageSplit`).
    - ``moe_tensor_parallel``: it runs ``t > 1`` on a mixture-of-experts model.
    - ``sharded_optimizer``: AdamW's state is sharded over the data x context ranks (dense
      weights) and the expert-data ranks (experts), ZeRO-1 (``engines/zero.py``).
    - ``whole_embedding_grad``: a vocabulary-parallel embedding's gradient is whole ``[V, h]`` on
      every tensor rank when FSDP2 does not wrap the model (nothing reduce-scatters it).
    - ``activation_slack``: measured CPU peak over the activations the plan lists (autograd's
      extra copies and allocator slack, docs/engines.md "Memory plan").
    - ``lora``: it trains a LoRA adapter (``actor.lora``); config validation refuses it elsewhere.
    - ``lora_experts``: it puts adapters on a mixture-of-experts layer's experts (else the memory
      plan refuses FFN targets on a MoE model, as the engine does)."""

    name: str
    kind: Kind
    letters: EngineLetters
    refusal_note: str = ""
    engine: str = ""
    sixteen_bit: SixteenBit = "fsdp2_cast"
    shards_over: tuple[str, ...] = ()
    vocab_parallel: bool = False
    sequence_parallel: bool = False
    context_kv_whole: bool = False
    stage_split: StageSplit = "even"
    moe_tensor_parallel: bool = True
    sharded_optimizer: bool = False
    whole_embedding_grad: bool = False
    activation_slack: float = 1.0
    lora: bool = False
    lora_experts: bool = True

    def shard_size(self, dims: ParallelDims) -> int:
        """Ranks FSDP2 shards one (dense) parameter over on ``dims``, and averages its gradient
        over (1: not sharded)."""
        return math.prod(getattr(dims, name) for name in self.shards_over)
