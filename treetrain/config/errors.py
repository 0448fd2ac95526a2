"""Engine errors, torch-free: config validation raises them before any engine is built
(:mod:`treetrain.engines.errors` re-exports them)."""


class EngineConfigError(ValueError):
    """A bad engine setting; the message says what to change."""


class CheckpointUnreadableError(EngineConfigError):
    """A checkpoint file that cannot be read (torn by a crash or a full disk): the trainer falls
    back to an older checkpoint instead of stopping."""
