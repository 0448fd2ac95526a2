"""Backend strings: parse ``sglang:d2t4``, ``fsdp:d4t2``, ``megatron:(attn:...|ffn:...)``
into parallel layouts and GPU counts, and lay them out on nodes. What each engine is (its
letters, how it slices and keeps its weights) is its description in the engine registry
(:mod:`.registry`), which every layer that asks reads.

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
from treetrain.alloc.model import Allocation, ParallelDims
from treetrain.alloc.parser import migrate, migration_yaml, parse
from treetrain.alloc.placement import PodPlan, plan_pods
from treetrain.alloc.registry import ENGINES, spec_of
from treetrain.alloc.spec import EngineLetters, EngineSpec

__all__ = [
    "ENGINES",
    "Allocation",
    "AllocationError",
    "AllocationSyntaxError",
    "AllocationValidationError",
    "EngineLetters",
    "EngineSpec",
    "LegacySpecError",
    "MissingBackendError",
    "ParallelDims",
    "PlacementError",
    "PodPlan",
    "migrate",
    "migration_yaml",
    "parse",
    "plan_pods",
    "spec_of",
]
