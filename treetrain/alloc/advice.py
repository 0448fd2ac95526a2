"""What would fit when a memory plan does not: one change at a time, each checked by the same
estimate (:func:`.plan.estimate`). Plain Python, no torch: ``treetrain memory`` and the
operator's ``rljob plan`` both call :func:`changes_that_fit`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from treetrain.alloc.lora import LoraShape
from treetrain.alloc.model import Allocation, ParallelDims
from treetrain.alloc.plan import GIB, MemoryPlan, estimate
from treetrain.alloc.registry import spec_of
from treetrain.alloc.shapes import MemoryInputError, ModelShape, check_layout

# GPU sizes (GiB) of common training GPUs (A100/H100 80, RTX PRO 6000 96, H200 141, B200 192).
COMMON_GPU_GIB = (80, 96, 141, 192)
# treetrain.tree's default block size (alloc and tree never import each other).
DEFAULT_BLOCK_SIZE = 128

Change = Literal["recompute", "dtype", "tokens", "layout"]


def exceeds_common_gpus(total_bytes: int) -> bool:
    """More than the largest of :data:`COMMON_GPU_GIB`: no common GPU holds it."""
    return total_bytes > max(COMMON_GPU_GIB) * GIB


def candidates(engine: str, gpus: int, m: ModelShape) -> list[Allocation]:
    """Layouts of ``engine`` over exactly ``gpus`` GPUs, most data-parallel first (they cost
    the least communication), each one the engine runs for this model."""
    out: list[tuple[tuple[int, ...], Allocation]] = []
    divisors = [k for k in range(1, gpus + 1) if gpus % k == 0]
    runs = spec_of(engine).letters.runs
    pps = divisors if "p" in runs else [1]
    eps = [1] + [e for e in divisors if e > 1 and m.is_moe and m.experts % e == 0] if "e" in runs else [1]
    for tp in divisors:
        for pp in pps:
            if gpus % (tp * pp) or pp > m.layers:
                continue
            for ep in eps:
                try:
                    alloc = Allocation(engine, ParallelDims(dp=gpus // (tp * pp), tp=tp, pp=pp, ep=ep))
                    check_layout(m, engine, alloc.dims)
                except (ValueError, MemoryInputError):
                    continue
                out.append(((tp * pp, -ep, pp), alloc))
    return [a for _, a in sorted(out, key=lambda x: x[0])]


def fitting_layout(
    config: Mapping[str, Any] | ModelShape,
    allocation: Allocation,
    limit_bytes: int,
    *,
    tokens: int,
    dtype: str = "auto",
    role: str = "actor",
    recompute: bool = False,
    max_gpus: int = 1024,
    block_size: int | None = None,
    lora: LoraShape | None = None,
) -> tuple[Allocation, MemoryPlan] | None:
    """The first layout of the same engine that fits in ``limit_bytes`` per GPU: the same GPU
    count sliced differently, then twice, four times ... the GPUs (None: none up to
    ``max_gpus``). ``block_size``: also skip layouts whose packing alignment
    (``lcm(block_size, t*c)``) does not divide ``tokens``."""
    m = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    gpus = allocation.world_size
    while gpus <= max_gpus:
        for alloc in candidates(allocation.backend, gpus, m):
            if block_size is not None and tokens % math.lcm(block_size, alloc.alignment):
                continue
            plan = estimate(m, alloc, tokens=tokens, dtype=dtype, role=role, recompute=recompute, lora=lora)
            if plan.largest.total <= limit_bytes:
                return alloc, plan
        gpus *= 2
    return None


@dataclass(frozen=True, slots=True)
class FitChange:
    """One change to a plan that does not fit, and the plan with that change, which fits.

    ``change``: ``recompute`` (gradient checkpointing on: ``model.gradientCheckpointing``),
    ``dtype`` (bfloat16 instead of float32: ``model.dtype``), ``tokens`` (the largest
    micro-batch cap that fits: ``actor.treeTraining.maxTokensPerMicrobatch``) or ``layout``
    (another backend string of the same engine). ``value``: the new setting, as text
    (``true``, ``bfloat16``, ``8192``, ``megatron:d2t4``)."""

    change: Change
    value: str
    plan: MemoryPlan

    @property
    def total(self) -> int:
        """Bytes per GPU of the changed plan's largest rank."""
        return self.plan.largest.total


def changes_that_fit(
    config: Mapping[str, Any] | ModelShape,
    plan: MemoryPlan,
    limit_bytes: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_gpus: int = 1024,
) -> list[FitChange]:
    """The single changes to ``plan`` (from :func:`estimate`) after which its largest rank fits
    in ``limit_bytes``, each checked by the same estimate, in this order:

    1. gradient checkpointing, when ``plan`` has it off;
    2. bfloat16, when ``plan`` is float32;
    3. fewer tree tokens per micro-batch: the largest multiple of ``lcm(block_size, t*c)``
       (the packer's alignment) below ``plan.tokens`` that fits;
    4. a layout of the same engine (:func:`fitting_layout`: the same GPU count sliced
       otherwise, else twice the GPUs, up to ``max_gpus``), with ``plan``'s other settings.

    Each keeps every other setting of ``plan`` (role, dtype, tokens, recompute, in-flight
    micro-batches). Empty when ``plan`` already fits, or when no single change makes it fit.
    For colocated engines (actor, critic and ref in the same pods), pass the bytes this
    engine may use: the GPU less the others' static bytes."""
    m = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    if plan.largest.total <= limit_bytes:
        return []
    settings: dict[str, Any] = {
        "tokens": plan.tokens,
        "dtype": plan.dtype,
        "role": plan.role,
        "recompute": plan.recompute,
        "in_flight": plan.in_flight,
        "lora": plan.lora,
    }

    def fits(**change: Any) -> MemoryPlan | None:
        changed = estimate(m, plan.allocation, **{**settings, **change})
        return changed if changed.largest.total <= limit_bytes else None

    out: list[FitChange] = []
    if not plan.recompute and (found := fits(recompute=True)) is not None:
        out.append(FitChange("recompute", "true", found))
    if plan.dtype == "float32" and (found := fits(dtype="bfloat16")) is not None:
        out.append(FitChange("dtype", "bfloat16", found))
    step = math.lcm(block_size, plan.allocation.alignment)
    low, high = 0, (plan.tokens - 1) // step  # multiples of step below plan.tokens: 1 .. high
    best: MemoryPlan | None = None
    while low < high:  # the largest k with k * step fitting; the estimate grows with the tokens
        k = (low + high + 1) // 2
        found = fits(tokens=k * step)
        if found is not None:
            low, best = k, found
        else:
            high = k - 1
    if low and best is not None:
        out.append(FitChange("tokens", str(low * step), best))
    layout = fitting_layout(
        m,
        plan.allocation,
        limit_bytes,
        tokens=plan.tokens,
        dtype=plan.dtype,
        role=plan.role,
        recompute=plan.recompute,
        max_gpus=max_gpus,
        block_size=block_size,
        lora=plan.lora,
    )
    if layout is not None:
        out.append(FitChange("layout", str(layout[0]), layout[1]))
    return out
