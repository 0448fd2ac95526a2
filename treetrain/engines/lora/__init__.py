"""LoRA in the engines: the core's part (:mod:`.core`: export, load, merged weights), the
PEFT adapter directory (:mod:`.peft_files`) and the adapter on a DTensor-sharded linear layer
(:mod:`.linear`, FSDP and Archon; Megatron's parallel linear layers have their own in
:mod:`treetrain.engines.megatron.lora`)."""

from treetrain.engines.lora.core import Adapters
from treetrain.engines.lora.peft_files import Adapter

__all__ = ["Adapter", "Adapters"]
