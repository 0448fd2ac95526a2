"""The FSDP engine, split the way torchtitan splits a model:

- :mod:`.layout`: the ``dp x tp`` mesh (:class:`FSDPLayout`, the engines' layout protocol);
- :mod:`.model`: one role's Hugging Face model (:mod:`treetrain.engines.hf_model`) spread over
  the ranks and loaded sharded;
- :mod:`.parallelize`: tensor parallel, then FSDP2 with mixed precision over fp32 master weights (:func:`parallelize`);
- :mod:`.engine`: :class:`FSDPEngine` (its hooks into the engine core,
  :class:`treetrain.engines.base.Engine`; the gradient norm is :mod:`treetrain.engines.grads`).

Build engines with :func:`treetrain.engines.build_engine`.
"""

from treetrain.engines.fsdp.engine import FSDPEngine
from treetrain.engines.fsdp.layout import FSDPLayout, init_layout
from treetrain.engines.fsdp.model import build_parallel, load_sharded
from treetrain.engines.fsdp.parallelize import apply_fsdp, apply_tp, parallelize

__all__ = [
    "FSDPEngine",
    "FSDPLayout",
    "apply_fsdp",
    "apply_tp",
    "build_parallel",
    "init_layout",
    "load_sharded",
    "parallelize",
]
