"""The memory plan of an RLJob: each component's memory per GPU (treetrain.alloc.memory) and
a refusal, naming a layout that fits, when it exceeds the GPUs' memory. Pure: the GPU size
comes from ``spec.gpuMemoryGiB`` or, else, from the caller (the ``nvidia.com/gpu.memory``
label of the nodes the pods can land on, see :func:`smallest_node_gpu_mib`).

Colocated trainer engines (actor, critic, ref in the same pods) add up: their parameters,
gradients and optimizer state live side by side, while their activations come and go in
turn (the trainer runs them one after the other), so the largest activation counts once.

The plan uses the trainer config the operator writes: ``model.dtype`` (``spec.model.dtype``,
``auto`` written out), ``model.gradientCheckpointing``, the micro-batch cap and ``actor.lora``
(the actor's base frozen, only its adapter with gradients and optimizer state). A refusal names
what would fit: the same layout with recompute or bfloat16, a layout of the same engine, or a
smaller micro-batch cap, each as the RLJob field to set. Without a GPU size nothing is refused,
but an estimate above every common GPU is a warning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from treetrain.alloc.memory import (
    COMMON_GPU_GIB,
    GIB,
    MemoryInputError,
    MemoryPlan,
    ModelShape,
    changes_that_fit,
    estimate,
    exceeds_common_gpus,
    server_weight_bytes,
)

if TYPE_CHECKING:
    from rljob_operator.components import Component
    from treetrain.config import TrainConfig

# NVIDIA GPU feature discovery's node label: the memory of one GPU, in MiB.
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
SERVER_NOTE = "weights only; the server fills the rest with its KV cache (its memory fraction) and CUDA graphs"
TOKENS_FIELD = "spec.actor.treeTraining.maxTokensPerMicrobatch"


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
    warnings: list[str] = field(default_factory=list)  # no GPU size, but larger than any common GPU

    def summary(self) -> dict[str, Any]:
        if self.skipped:
            return {"checked": False, "why": self.skipped}
        return {
            "checked": self.limit_bytes is not None,
            "gpu_bytes": self.limit_bytes,
            "gpu_memory_from": self.limit_source,
            "warnings": self.warnings,
            "components": {
                r.component: {"backend": r.backend, "per_gpu_bytes": r.per_gpu, **r.parts, "note": r.note}
                for r in self.rows
            },
        }

    def lines(self) -> list[str]:
        if self.skipped:
            return [f"memory: not checked ({self.skipped})"]
        if self.limit_bytes is None:
            head = "memory per GPU, GPU memory unknown (set spec.gpuMemoryGiB): not checked:"
        elif self.problems:
            head = f"memory per GPU: does not fit the {self.limit_bytes / GIB:.1f} GiB GPUs ({self.limit_source}):"
        else:
            head = f"memory per GPU: fits the {self.limit_bytes / GIB:.1f} GiB GPUs ({self.limit_source}):"
        out = [head]
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
    backend_paths: Mapping[str, str] | None = None,
) -> MemoryReport:
    """Every component's memory per GPU and the problems of those that do not fit;
    ``backend_paths``: each rollout component's backend field (``spec.additionalRollouts[1].backend``)."""
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
    warnings: list[str] = []
    largest = max(COMMON_GPU_GIB) * GIB
    try:
        trainer = _trainer(shape, components, config)
    except MemoryInputError as err:  # what the engine would refuse for this model (an adapter it cannot put)
        return MemoryReport(problems=[(f"spec.{err.field}" if err.field else "spec.actor.backend", str(err))])
    if trainer is not None:
        row, plans = trainer
        rows.append(row)
        if limit is not None and row.per_gpu > limit:
            hints = "; ".join(_hints(shape, plans, config, limit))
            problems.append(
                ("spec.actor.backend", f"{_need(row)} but the GPUs have {limit / GIB:.1f} GiB ({source}); {hints}")
            )
        elif limit is None and exceeds_common_gpus(row.per_gpu):
            hints = "; ".join(_hints(shape, plans, config, largest))
            common = ", ".join(map(str, COMMON_GPU_GIB))
            warnings.append(
                f"{_need(row)}, more than any common GPU ({common} GiB), not checked without spec.gpuMemoryGiB; "
                f"to fit {largest / GIB:.0f} GiB: {hints}"
            )
    for name, c in components.items():
        if c.allocation.kind != "inference":
            continue
        weights = server_weight_bytes(shape, c.allocation)
        rows.append(Row(name, str(c.allocation), weights, {"weights": weights}, f"  {SERVER_NOTE}"))
        if weights > (limit if limit is not None else largest):
            more = c.allocation.dims.tp * 2
            path = (backend_paths or {}).get(name, "spec.rollout.backend")
            gpus = f"the {limit / GIB:.1f} GiB of {source}" if limit is not None else "any common GPU's memory"
            message = (
                f"{c.allocation}: the weights alone take {weights / GIB:.1f} GiB per GPU, more than {gpus}; split "
                f"them over more GPUs, e.g. t{more}"
            )
            if limit is not None:
                problems.append((path, message))
            else:
                warnings.append(f"{path}: {message}")
    return MemoryReport(rows=rows, limit_bytes=limit, limit_source=source, problems=problems, warnings=warnings)


def _limit(gpu_memory_gib: float | None, node_gpu_mib: int | None) -> tuple[int | None, str]:
    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * GIB), "spec.gpuMemoryGiB"
    if node_gpu_mib is not None:
        return node_gpu_mib * 1024 * 1024, f"the smallest node's {GPU_MEMORY_LABEL} label, {node_gpu_mib} MiB"
    return None, ""


def _settings(config: TrainConfig) -> dict[str, Any]:
    return {
        "tokens": config.actor.tree_training.max_tokens_per_mb,
        # The operator writes auto out (layout.trainer_dtype); the plan reads auto as bfloat16 too.
        "dtype": config.model.dtype,
        "recompute": config.model.gradient_checkpointing,
        "lora": config.actor.lora.shape() if config.actor.lora is not None else None,
    }


def _trainer_plans(shape: ModelShape, engines: Sequence[Component], settings: Mapping[str, Any]) -> list[MemoryPlan]:
    """Each trainer engine's plan; only the actor carries the adapter (critic and ref train none)."""
    rest = {k: v for k, v in settings.items() if k != "lora"}
    return [
        estimate(shape, c.allocation, role=c.role, **rest, lora=settings["lora"] if c.role == "actor" else None)
        for c in engines
    ]


def _per_gpu(plans: Sequence[MemoryPlan]) -> int:
    """Colocated engines' static memory side by side, their largest activations once."""
    return sum(p.largest.total - p.largest.activations for p in plans) + max(p.largest.activations for p in plans)


def _trainer(
    shape: ModelShape, components: Mapping[str, Component], config: TrainConfig
) -> tuple[Row, list[Component]] | None:
    """The trainer pods' memory per GPU: actor plus its colocated critic and ref."""
    engines = [c for c in components.values() if c.allocation.kind == "training"]
    if not engines:
        return None
    plans = _trainer_plans(shape, engines, _settings(config))
    parts: dict[str, int] = {}
    for p in plans:
        for key in ("parameters", "gradients", "optimizer"):
            parts[key] = parts.get(key, 0) + p.largest.to_dict()[key]
    parts["activations (estimate)"] = max(p.largest.activations for p in plans)
    backend = (
        " + ".join(f"{c.name} {c.allocation}" for c in engines) if len(engines) > 1 else str(engines[0].allocation)
    )
    name = "trainer" if len(engines) > 1 else engines[0].name
    return Row(name, backend, _per_gpu(plans), parts), engines


def _need(row: Row) -> str:
    return (
        f"{row.backend} needs about {row.per_gpu / GIB:.1f} GiB per GPU "
        f"({', '.join(f'{k} {v / GIB:.1f}' for k, v in row.parts.items())})"
    )


def _hints(shape: ModelShape, engines: list[Component], config: TrainConfig, limit: int) -> list[str]:
    """What fits in ``limit`` per GPU, each as the RLJob field to set: the single changes of
    ``treetrain.alloc.memory.changes_that_fit`` (recompute, bfloat16, a smaller micro-batch cap,
    a layout of the same engine; the colocated engines keep their static share), or else
    recompute and bfloat16 together."""
    settings = _settings(config)
    plans = _trainer_plans(shape, engines, settings)
    actor = plans[0]
    others = sum(p.largest.total - p.largest.activations for p in plans[1:])
    changes = changes_that_fit(shape, actor, max(limit - others, 1), block_size=config.actor.tree_training.block_size)
    hints = []
    for c in changes:
        need = (c.total + others) / GIB
        if c.change == "layout":
            hints.append(f"{c.value} fits ({c.total / GIB:.1f} GiB for the actor)")
        else:
            hints.append(f"with {_FIELDS[c.change]}: {c.value} it needs about {need:.1f} GiB")
    precision = any(c.change in ("recompute", "dtype") for c in changes)
    if not precision and not settings["recompute"] and actor.dtype == "float32":
        both = _per_gpu(_trainer_plans(shape, engines, {**settings, "recompute": True, "dtype": "bfloat16"}))
        if both <= limit:
            hints.insert(0, f"with {_FIELDS['recompute']}: true and {_FIELDS['dtype']}: bfloat16 it needs about "
                            f"{both / GIB:.1f} GiB")  # fmt: skip
    if not hints:
        hints.append(
            f"no single change fits: no {actor.allocation.backend} layout up to 1024 GPUs, no smaller {TOKENS_FIELD}"
            f"{'' if settings['recompute'] else ', no spec.model.gradientCheckpointing'}; try another engine or a "
            "larger GPU"
        )
    return hints


_FIELDS = {"recompute": "spec.model.gradientCheckpointing", "dtype": "spec.model.dtype", "tokens": TOKENS_FIELD}
