"""What each training engine runs, as config validation asks it: a view of the one table,
:data:`treetrain.alloc.ENGINE_LETTERS`, that the parser, admission (the operator,
``rljob plan``), config validation and :func:`treetrain.engines.build_engine` consult.

A backend string the parser accepts but the engine cannot run is refused here, at validation
time, with the reason and a string that would run, never inside a pod.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from treetrain.alloc import ENGINE_LETTERS, TRAINING_BACKENDS, Allocation, parse
from treetrain.alloc.model import LETTER_FIELD
from treetrain.config.errors import EngineConfigError


@dataclass(frozen=True, slots=True)
class EngineSupport:
    built: bool
    # field (cp) -> why this engine does not run it yet (the parser refuses what no engine of
    # the kind could run, e.g. fsdp with p or e).
    refused: dict[str, str]


# Derived, never written twice: ENGINE_LETTERS holds the facts.
ENGINES: dict[str, EngineSupport] = {
    backend: EngineSupport(
        built=ENGINE_LETTERS[backend].built,
        refused={LETTER_FIELD[letter]: why for letter, why in ENGINE_LETTERS[backend].not_yet.items()},
    )
    for backend in TRAINING_BACKENDS
}


def _data_and_tensor(allocation: Allocation, backend: str) -> str:
    """A ``backend`` string over the same GPUs with only d and t (what every engine runs)."""
    dims = allocation.dims
    dp = allocation.world_size // dims.tp
    return f"{backend}:d{dp}" + (f"t{dims.tp}" if dims.tp > 1 else "")


def check_engine_support(allocation: Allocation) -> Allocation:
    """Check that the engine of a parsed ``allocation`` runs it; raises
    :class:`EngineConfigError` with the fix, or returns ``allocation``."""
    if allocation.kind != "training":
        raise EngineConfigError(
            f"{str(allocation)!r} is an inference backend; a trainer needs fsdp:..., megatron:... or archon:..."
        )
    if not allocation.letters.built:
        raise EngineConfigError(
            f"the {allocation.backend} engine is not built yet in this release; "
            f"use the FSDP engine on the same GPUs: {_data_and_tensor(allocation, 'fsdp')}"
        )
    refused = allocation.not_yet_run()
    if refused is not None:
        letter, size, reason = refused
        raise EngineConfigError(
            # The canonical string: the words are the same whoever wrote the dims in which order.
            f"{reason} ({letter}{size} in {str(allocation)!r}); fix: drop it and raise d or t instead, "
            f"e.g. {_data_and_tensor(allocation, allocation.backend)}"
        )
    return allocation


@lru_cache(maxsize=64)
def check_training_backend(backend: str) -> Allocation:
    """Parse ``backend`` and check that its engine runs it; raises :class:`EngineConfigError`
    (or the parser's :class:`AllocationError`) with the fix. Cached: a pod parses each of its
    strings once (config validation), and the trainer's later calls get the same object."""
    allocation = parse(backend)
    if allocation.kind != "training":
        raise EngineConfigError(
            f"{backend!r} is an inference backend; a trainer needs fsdp:..., megatron:... or archon:..."
        )
    return check_engine_support(allocation)
