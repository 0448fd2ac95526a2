"""The trainer config: one torch-free schema (:mod:`.schema`) that the trainer, ``rljob plan``
and the operator all validate with, cross-section rules (:mod:`.check`), what each engine
runs (:mod:`.backends`), and reading YAML plus the environment (:mod:`.load`)."""

from treetrain.config.backends import check_training_backend, engines
from treetrain.config.defaults import embedded_default
from treetrain.config.load import (
    ENV_OVERRIDES,
    ConfigError,
    Launch,
    dump_yaml,
    load,
    load_default,
    read_yaml,
    validate,
    validate_with_launch,
)
from treetrain.config.schema import (
    ActorSettings,
    CheckpointSettings,
    ModelSettings,
    RoleSettings,
    RolloutServer,
    RolloutServers,
    TrainConfig,
    TreeTrainingSettings,
    WeightSyncSettings,
)
from treetrain.config.trainer_settings import (
    LossSettings,
    MetricsSettings,
    OptimizerSettings,
    SamplingSettings,
    TrainerSettings,
    ValueLossSettings,
    WandbSettings,
)
from treetrain.tree.pack import DEFAULT_BLOCK_SIZE  # re-exported: the one definition lives in the bottom layer

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "ENV_OVERRIDES",
    "ActorSettings",
    "CheckpointSettings",
    "ConfigError",
    "Launch",
    "LossSettings",
    "MetricsSettings",
    "ModelSettings",
    "OptimizerSettings",
    "RoleSettings",
    "RolloutServer",
    "RolloutServers",
    "SamplingSettings",
    "TrainConfig",
    "TrainerSettings",
    "TreeTrainingSettings",
    "ValueLossSettings",
    "WandbSettings",
    "WeightSyncSettings",
    "check_training_backend",
    "dump_yaml",
    "embedded_default",
    "engines",
    "load",
    "load_default",
    "read_yaml",
    "validate",
    "validate_with_launch",
]
