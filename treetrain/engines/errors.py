"""Engine errors, torch-free: config validation raises them before any engine is built."""


class EngineConfigError(ValueError):
    """A bad engine setting; the message says what to change."""
