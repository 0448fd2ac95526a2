"""The memory plan of an RLJob: each component's memory per GPU (treetrain.alloc.memory) and
a refusal, naming a layout that fits, when it exceeds the GPUs' memory. Pure: the GPU size
comes from ``spec.gpuMemoryGiB`` or, else, from the caller (the ``nvidia.com/gpu.memory``
label of the nodes the pods can land on, see :func:`smallest_node_gpu_mib`).

Colocated trainer engines (actor, critic, ref in the same pods) add up: their parameters,
gradients and optimizer state live side by side, while their activations come and go in
turn (the trainer runs them one after the other), so the largest activation counts once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from treetrain.alloc.memory import (
    GIB,
    MemoryInputError,
    MemoryPlan,
    ModelShape,
    estimate,
    fitting_layout,
    server_weight_bytes,
)

if TYPE_CHECKING:
    from rljob_operator.components import Component
    from treetrain.config import TrainConfig

# NVIDIA GPU feature discovery's node label: the memory of one GPU, in MiB.
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
SERVER_NOTE = "weights only; the server fills the rest with its KV cache (its memory fraction) and CUDA graphs"


@dataclass(frozen=True)
class Row:
    """One component's memory per GPU (bytes)."""

    component: str
    backend: str
    per_gpu: int
    parts: dict[str, int]
    note: str = ""


@dataclass(frozen=True)
class MemoryReport:
    """What ``rljob plan`` prints and the operator checks."""

    rows: list[Row] = field(default_factory=list)
    limit_bytes: int | None = None
    limit_source: str = ""
    problems: list[tuple[str, str]] = field(default_factory=list)  # (field path, message)
    skipped: str = ""  # why nothing was checked

    def summary(self) -> dict[str, Any]:
        if self.skipped:
            return {"checked": False, "why": self.skipped}
        return {
            "checked": self.limit_bytes is not None,
            "gpu_bytes": self.limit_bytes,
            "gpu_memory_from": self.limit_source,
            "components": {
                r.component: {"backend": r.backend, "per_gpu_bytes": r.per_gpu, **r.parts, "note": r.note}
                for r in self.rows
            },
        }

    def lines(self) -> list[str]:
        if self.skipped:
            return [f"memory: not checked ({self.skipped})"]
        size = (
            f"{self.limit_bytes / GIB:.1f} GiB per GPU ({self.limit_source})"
            if self.limit_bytes is not None
            else "GPU memory unknown (set spec.gpuMemoryGiB): not checked"
        )
        out = [f"memory per GPU, {size}:"]
        for r in self.rows:
            parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in r.parts.items())
            out.append(f"  {r.component:<16}{r.backend:<40}{r.per_gpu / GIB:>8.1f} GiB  ({parts}){r.note}")
        return out


def smallest_node_gpu_mib(nodes: Sequence[Mapping[str, Any]], selector: Mapping[str, str]) -> int | None:
    """The smallest ``nvidia.com/gpu.memory`` label (MiB) among nodes matching ``selector``
    (None: no matching node carries the label)."""
    sizes = []
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            continue
        value = labels.get(GPU_MEMORY_LABEL)
        if isinstance(value, str) and value.isdigit() and int(value) > 0:
            sizes.append(int(value))
    return min(sizes) if sizes else None


def check_memory(
    model_config: Mapping[str, Any] | None,
    components: Mapping[str, Component],
    config: TrainConfig | None,
    *,
    gpu_memory_gib: float | None,
    node_gpu_mib: int | None,
) -> MemoryReport:
    """Every component's memory per GPU and the problems of those that do not fit."""
    if model_config is None:
        return MemoryReport(skipped="no model config: give spec.model.config (or rljob plan --model-config)")
    if config is None:
        return MemoryReport(skipped="the trainer config did not validate")
    try:
        shape = ModelShape.from_config(model_config)
    except MemoryInputError as err:
        return MemoryReport(problems=[("spec.model.config", str(err))])
    limit, source = _limit(gpu_memory_gib, node_gpu_mib)
    rows: list[Row] = []
    problems: list[tuple[str, str]] = []
    trainer = _trainer(shape, components, config)
    if trainer is not None:
        row, plans = trainer
        rows.append(row)
        if limit is not None and row.per_gpu > limit:
            problems.append(("spec.actor.backend", _refusal(shape, row, plans, config, limit, source)))
    for name, c in components.items():
        if c.allocation.kind != "inference":
            continue
        weights = server_weight_bytes(shape, c.allocation)
        rows.append(Row(name, str(c.allocation), weights, {"weights": weights}, f"  {SERVER_NOTE}"))
        if limit is not None and weights > limit:
            more = c.allocation.dims.tp * 2
            path = "spec.rollout.backend" if name == "rollout" else f"spec.additionalRollouts[{name}].backend"
            problems.append(
                (
                    path,
                    f"{c.allocation}: the weights alone take {weights / GIB:.1f} GiB per GPU, more than the "
                    f"{limit / GIB:.1f} GiB of {source}; split them over more GPUs, e.g. t{more}",
                )
            )
    return MemoryReport(rows=rows, limit_bytes=limit, limit_source=source, problems=problems)


def _limit(gpu_memory_gib: float | None, node_gpu_mib: int | None) -> tuple[int | None, str]:
    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * GIB), "spec.gpuMemoryGiB"
    if node_gpu_mib is not None:
        return node_gpu_mib * 1024 * 1024, f"the smallest node's {GPU_MEMORY_LABEL} label, {node_gpu_mib} MiB"
    return None, ""


def _settings(config: TrainConfig) -> dict[str, Any]:
    return {
        "tokens": config.actor.tree_training.max_tokens_per_mb,
        "dtype": config.model.dtype,
        "recompute": config.model.gradient_checkpointing,
    }


def _trainer(
    shape: ModelShape, components: Mapping[str, Component], config: TrainConfig
) -> tuple[Row, list[MemoryPlan]] | None:
    """The trainer pods' memory per GPU: actor plus its colocated critic and ref."""
    engines = [c for c in components.values() if c.allocation.kind == "training"]
    if not engines:
        return None
    plans = [estimate(shape, c.allocation, role=c.role, **_settings(config)) for c in engines]
    static = sum(p.largest.total - p.largest.activations for p in plans)
    activations = max(p.largest.activations for p in plans)
    parts: dict[str, int] = {}
    for p in plans:
        for key in ("parameters", "gradients", "optimizer"):
            parts[key] = parts.get(key, 0) + p.largest.to_dict()[key]
    parts["activations (estimate)"] = activations
    backend = (
        " + ".join(f"{c.name} {c.allocation}" for c in engines) if len(engines) > 1 else str(engines[0].allocation)
    )
    name = "trainer" if len(engines) > 1 else engines[0].name
    return Row(name, backend, static + activations, parts), plans


def _refusal(shape: ModelShape, row: Row, plans: list[MemoryPlan], config: TrainConfig, limit: int, source: str) -> str:
    """Why the trainer does not fit, and a layout that does: the actor's engine sliced
    otherwise, on as many GPUs or more (the colocated engines keep their share)."""
    actor = plans[0]
    others = sum(p.largest.total - p.largest.activations for p in plans[1:])
    head = (
        f"{row.backend} needs about {row.per_gpu / GIB:.1f} GiB per GPU "
        f"({', '.join(f'{k} {v / GIB:.1f}' for k, v in row.parts.items())}) but the GPUs have "
        f"{limit / GIB:.1f} GiB ({source})"
    )
    settings = _settings(config)
    found = fitting_layout(shape, actor.allocation, max(limit - others, 1), role=actor.role, **settings)
    hints = []
    if found is not None:
        alloc, plan = found
        hints.append(f"{alloc} fits ({plan.largest.total / GIB:.1f} GiB for the actor)")
    if not hints:
        hints.append(f"no {actor.allocation.backend} layout up to 1024 GPUs fits; lower maxTokensPerMb")
    return f"{head}; {'; '.join(hints)}"
