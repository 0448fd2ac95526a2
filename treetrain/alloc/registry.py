"""The engine registry: every engine's description (:mod:`.specs`), one line each.

The parser (which backends and letters exist, and its messages), the memory plan (how each
engine slices and keeps its weights), config validation (what each engine runs), the operator
(its CEL rule and messages) and the engine factory (which class to build) all read this
registry through the functions below, at call time, so a description added here (or by a test)
changes what each of them accepts. Adding an engine: docs/engines.md, "Adding an engine".

Order matters only for messages: rollout servers first, then trainers, the default trainer first.
"""

from __future__ import annotations

from collections.abc import Iterable

from treetrain.alloc.spec import EngineSpec, Kind
from treetrain.alloc.specs.archon import ARCHON
from treetrain.alloc.specs.fsdp import FSDP
from treetrain.alloc.specs.megatron import MEGATRON
from treetrain.alloc.specs.servers import SGLANG, VLLM

ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        SGLANG,
        VLLM,
        FSDP,
        MEGATRON,
        ARCHON,
    )
}


def spec_of(name: str) -> EngineSpec:
    """The description of backend ``name`` (``KeyError`` for a name not registered)."""
    return ENGINES[name]


def names(kind: Kind | None = None) -> tuple[str, ...]:
    """Registered backend names, of one ``kind`` or all, in registry order."""
    return tuple(name for name, spec in ENGINES.items() if kind is None or spec.kind == kind)


def hybrid_names() -> tuple[str, ...]:
    """Backends that take the hybrid MoE form ``backend:(attn:...|ffn:...)``."""
    return tuple(name for name, spec in ENGINES.items() if spec.letters.hybrid)


def running(letters: Iterable[str]) -> tuple[str, ...]:
    """Built training engines that run every one of ``letters`` (plain strings)."""
    wanted = set(letters)
    return tuple(
        name
        for name, spec in ENGINES.items()
        if spec.kind == "training" and spec.letters.built and wanted <= set(spec.letters.runs)
    )


def default_training() -> str:
    """The first built training engine: what a message offers when nothing else runs a string."""
    return running("")[0]


def either(items: Iterable[str], *, last: str = "or") -> str:
    """``a``, ``a or b``, ``a, b or c``: a list as a message writes it."""
    words = list(items)
    if len(words) <= 1:
        return "".join(words)
    return f"{', '.join(words[:-1])} {last} {words[-1]}"


def prefixes(kind: Kind) -> str:
    """``fsdp:..., megatron:... or archon:...``: the backends of ``kind`` as strings start."""
    return either(f"{name}:..." for name in names(kind))
