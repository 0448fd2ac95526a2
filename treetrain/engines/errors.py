"""Engine errors: defined in the torch-free bottom (:mod:`treetrain.config.errors`), since
config validation raises them before any engine is built; re-exported here, where engine
code and users import them."""

from treetrain.config.errors import CheckpointUnreadableError, EngineConfigError

__all__ = ["CheckpointUnreadableError", "EngineConfigError"]
