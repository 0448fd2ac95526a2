"""The Archon engine: PyTorch-native models written for this project, torchtitan-style.

- :mod:`.model`: ``ModelArgs`` from a Hugging Face config, the ``Transformer`` (Llama,
  Qwen2, Qwen3, Qwen3-MoE) and the Hugging Face weight adapter; no parallelism inside;
- :mod:`.layout`: one mapping from a backend string to the device meshes;
- :mod:`.parallelize`: ``apply_*`` functions (tensor, context parallel, activation
  checkpointing, compile, FSDP2);
- :mod:`.engine`: :class:`ArchonEngine`.

Build engines with :func:`treetrain.engines.build_engine` (``archon:...``).
"""

from treetrain.engines.archon.engine import ArchonEngine
from treetrain.engines.archon.layout import ArchonLayout, init_layout, mesh_shapes

__all__ = ["ArchonEngine", "ArchonLayout", "init_layout", "mesh_shapes"]
