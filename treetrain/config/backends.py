"""What each training engine runs, as config validation asks it: a view of the engine
registry (:mod:`treetrain.alloc.registry`, each engine's description) that the parser,
admission (the operator, ``rljob plan``), config validation and
:func:`treetrain.engines.build_engine` consult.

A backend string the parser accepts but the engine cannot run is refused here, at validation
time, with the reason and a string that would run, never inside a pod.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from treetrain.alloc import Allocation, parse
from treetrain.alloc.model import LETTER_FIELD
from treetrain.alloc.registry import default_training, names, prefixes, spec_of
from treetrain.config.errors import EngineConfigError


@dataclass(frozen=True, slots=True)
class EngineSupport:
    built: bool
    # field (cp) -> why this engine does not run it yet (the parser refuses what no engine of
    # the kind could run, e.g. fsdp with p or e).
    refused: dict[str, str]


def engines() -> dict[str, EngineSupport]:
    """Each training engine's support, derived from its description (never written twice)."""
    return {
        backend: EngineSupport(
            built=spec_of(backend).letters.built,
            refused={LETTER_FIELD[letter]: why for letter, why in spec_of(backend).letters.not_yet.items()},
        )
        for backend in names("training")
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
        raise EngineConfigError(f"{str(allocation)!r} is an inference backend; a trainer needs {prefixes('training')}")
    if not allocation.letters.built:
        other = default_training()
        raise EngineConfigError(
            f"the {allocation.backend} engine is not built yet in this release; "
            f"use the {other} engine on the same GPUs: {_data_and_tensor(allocation, other)}"
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
        raise EngineConfigError(f"{backend!r} is an inference backend; a trainer needs {prefixes('training')}")
    return check_engine_support(allocation)
