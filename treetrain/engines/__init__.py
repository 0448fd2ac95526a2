"""Training engines behind one interface (:class:`Engine`) and one factory (:func:`build_engine`).

Importing this package stays torch-free (config validation reads :mod:`.builtin` and
:mod:`.errors`); the torch-backed names load on first use.
"""

from typing import TYPE_CHECKING, Any

from treetrain.engines.errors import EngineConfigError

if TYPE_CHECKING:
    from treetrain.engines.base import Engine, Loss, MicroBatchOutput, StepStats, TrainBatch
    from treetrain.engines.factory import build_engine

_LAZY = {
    "Engine": "treetrain.engines.base",
    "Loss": "treetrain.engines.base",
    "MicroBatchOutput": "treetrain.engines.base",
    "StepStats": "treetrain.engines.base",
    "TrainBatch": "treetrain.engines.base",
    "build_engine": "treetrain.engines.factory",
}

__all__ = ["Engine", "EngineConfigError", "Loss", "MicroBatchOutput", "StepStats", "TrainBatch", "build_engine"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'treetrain.engines' has no attribute {name!r}")
