"""The FSDP engine, split the way torchtitan splits a model:

- :mod:`.model`: building the model from a resolved :class:`~treetrain.engines.source.ModelSource` (:func:`build_model`, :class:`ValueModel` for the critic) and loading it sharded;
- :mod:`.parallelize`: tensor parallel, then FSDP2 with mixed precision over fp32 master weights (:func:`parallelize`);
- :mod:`.engine`: :class:`FSDPEngine` (its hooks into the engine core,
  :class:`treetrain.engines.base.Engine`; the gradient norm is :mod:`treetrain.engines.grads`).

Build engines with :func:`treetrain.engines.build_engine`.
"""

from treetrain.engines.base import ROLES
from treetrain.engines.fsdp.engine import FSDPEngine
from treetrain.engines.fsdp.model import ValueModel, build_model, hf_config, load_sharded
from treetrain.engines.fsdp.parallelize import apply_fsdp, apply_tp, parallelize

__all__ = [
    "ROLES",
    "FSDPEngine",
    "ValueModel",
    "apply_fsdp",
    "apply_tp",
    "build_model",
    "hf_config",
    "load_sharded",
    "parallelize",
]
