"""The Megatron engine (megatron-core, the ``megatron`` extra), split like the FSDP engine:

- :mod:`.parallel`: one mapping from an :class:`~treetrain.alloc.Allocation` to Megatron's
  parallel state (:func:`init_megatron`);
- :mod:`.model`: ``GPTModel`` from a Hugging Face config with tree attention as its core
  attention and RoPE at tree positions (:class:`TreeGPT`);
- :mod:`.convert`: Hugging Face <-> Megatron weights, rank-local reads, export;
- :mod:`.logprob`: log-probs from vocab-parallel logits;
- :mod:`.engine`: :class:`MegatronEngine` (packing, the pipeline schedule, gradients,
  optimizer, checkpoints, export).

Build engines with :func:`treetrain.engines.build_engine`.
"""

from treetrain.engines.megatron.engine import MegatronEngine
from treetrain.engines.megatron.parallel import MegatronLayout, init_megatron, megatron_sizes

__all__ = ["MegatronEngine", "MegatronLayout", "init_megatron", "megatron_sizes"]
