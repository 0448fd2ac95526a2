"""Training engines behind one interface (:class:`Engine`) and one factory (:func:`build_engine`).

Importing this package stays torch-free (config validation reads :mod:`.builtin` and
:mod:`.errors`); the torch-backed names load on first use.
"""

from typing import TYPE_CHECKING, Any

from treetrain.engines.errors import EngineConfigError

if TYPE_CHECKING:
    from treetrain.engines.base import Engine
    from treetrain.engines.batch import TokenFields, TrainBatch
    from treetrain.engines.contract import Loss, MicroBatchOutput
    from treetrain.engines.factory import build_engine
    from treetrain.engines.hf_model import build_model
    from treetrain.engines.layout import Layout
    from treetrain.engines.stats import StepStats

_LAZY = {
    "Engine": "treetrain.engines.base",
    "Layout": "treetrain.engines.layout",
    "Loss": "treetrain.engines.contract",
    "MicroBatchOutput": "treetrain.engines.contract",
    "StepStats": "treetrain.engines.stats",
    "TokenFields": "treetrain.engines.batch",
    "TrainBatch": "treetrain.engines.batch",
    "build_engine": "treetrain.engines.factory",
    "build_model": "treetrain.engines.hf_model",
}

__all__ = [
    "Engine",
    "EngineConfigError",
    "Layout",
    "Loss",
    "MicroBatchOutput",
    "StepStats",
    "TokenFields",
    "TrainBatch",
    "build_engine",
    "build_model",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'treetrain.engines' has no attribute {name!r}")
