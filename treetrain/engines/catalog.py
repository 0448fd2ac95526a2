"""The built-in models' catalogue lives in :mod:`treetrain.config.catalog` (config validation
checks names against it, and config sits below the engines); re-exported here for old imports."""

from treetrain.config.catalog import (
    NAMES,
    PACKAGED_MODELS,
    PREFIX,
    RANDOM_MODELS,
    PackagedModel,
    check_path,
    random_config,
)

__all__ = ["NAMES", "PACKAGED_MODELS", "PREFIX", "RANDOM_MODELS", "PackagedModel", "check_path", "random_config"]
