"""What each training engine runs: the one table that admission (the operator, ``rljob plan``),
config validation and :func:`treetrain.engines.build_engine` consult.

A backend string the parser accepts but the engine cannot run is refused here, at validation
time, with the reason and a string that would run, never inside a pod.
"""

from __future__ import annotations

from dataclasses import dataclass

from treetrain.alloc import Allocation, parse
from treetrain.engines.errors import EngineConfigError


@dataclass(frozen=True, slots=True)
class EngineSupport:
    built: bool
    # letter -> why this engine does not run it yet (the parser refuses what no engine of
    # the kind could run, e.g. fsdp with p or e).
    refused: dict[str, str]


ENGINES: dict[str, EngineSupport] = {
    "fsdp": EngineSupport(built=True, refused={"cp": "context parallelism is not supported by the FSDP engine yet"}),
    "megatron": EngineSupport(built=True, refused={}),
    "archon": EngineSupport(
        built=True,
        refused={},
    ),
}


def _data_and_tensor(allocation: Allocation, backend: str) -> str:
    """A ``backend`` string over the same GPUs with only d and t (what every engine runs)."""
    dims = allocation.dims
    dp = allocation.world_size // dims.tp
    return f"{backend}:d{dp}" + (f"t{dims.tp}" if dims.tp > 1 else "")


def check_training_backend(backend: str) -> Allocation:
    """Parse ``backend`` and check that its engine runs it; raises :class:`EngineConfigError`
    (or the parser's :class:`AllocationError`) with the fix."""
    allocation = parse(backend)
    if allocation.kind != "training":
        raise EngineConfigError(
            f"{backend!r} is an inference backend; a trainer needs fsdp:..., megatron:... or archon:..."
        )
    support = ENGINES[allocation.backend]
    if not support.built:
        raise EngineConfigError(
            f"the {allocation.backend} engine is not built yet in this release; "
            f"use the FSDP engine on the same GPUs: {_data_and_tensor(allocation, 'fsdp')}"
        )
    dims = allocation.dims
    for letter, reason in support.refused.items():
        size = getattr(dims, letter)
        if size > 1:
            raise EngineConfigError(
                # The canonical string: the words are the same whoever wrote the dims in which order.
                f"{reason} ({letter[0]}{size} in {str(allocation)!r}); fix: drop it and raise d or t instead, "
                f"e.g. {_data_and_tensor(allocation, allocation.backend)}"
            )
    return allocation


def alignment_size(allocation: Allocation) -> int:
    """Tokens of a packed tree must split evenly over this many ranks: tensor parallel (sequence
    parallel) times context parallel, which splits each tree's rows (the FSDP engine refuses
    ``c``). The engines pack with the same size (``Engine._pack_config``)."""
    dims = allocation.dims
    return dims.tp * dims.cp
