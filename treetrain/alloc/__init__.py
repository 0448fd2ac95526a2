"""Backend strings: parse ``sglang:d2t4``, ``fsdp:d4t2``, ``megatron:(attn:...|ffn:...)``
into parallel layouts and GPU counts, and lay them out on nodes.

Plain Python with no torch: the operator image imports this.
"""

from treetrain.alloc.errors import (
    AllocationError,
    AllocationSyntaxError,
    AllocationValidationError,
    LegacySpecError,
    MissingBackendError,
    PlacementError,
)
from treetrain.alloc.model import (
    BACKENDS,
    ENGINE_LETTERS,
    INFERENCE_BACKENDS,
    TRAINING_BACKENDS,
    Allocation,
    EngineLetters,
    ParallelDims,
)
from treetrain.alloc.parser import migrate, migration_yaml, parse
from treetrain.alloc.placement import PodPlan, plan_pods

__all__ = [
    "BACKENDS",
    "ENGINE_LETTERS",
    "INFERENCE_BACKENDS",
    "TRAINING_BACKENDS",
    "Allocation",
    "AllocationError",
    "AllocationSyntaxError",
    "AllocationValidationError",
    "EngineLetters",
    "LegacySpecError",
    "MissingBackendError",
    "ParallelDims",
    "PlacementError",
    "PodPlan",
    "migrate",
    "migration_yaml",
    "parse",
    "plan_pods",
]
