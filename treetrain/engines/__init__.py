"""Training engines: one interface (:class:`Engine`), the FSDP engine now; Megatron and Archon later."""

from treetrain.engines.base import (
    Engine,
    EngineConfigError,
    Loss,
    MicroBatchOutput,
    OptimConfig,
    StepStats,
    TrainBatch,
    TreeTrainingConfig,
)

__all__ = [
    "Engine",
    "EngineConfigError",
    "Loss",
    "MicroBatchOutput",
    "OptimConfig",
    "StepStats",
    "TrainBatch",
    "TreeTrainingConfig",
]
